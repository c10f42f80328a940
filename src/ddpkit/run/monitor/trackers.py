"""Experiment trackers: rank 0 sends every metrics line to TensorBoard, MLflow and W&B.

``Monitor`` builds ``Trackers`` on global rank 0 when the loop starts and hands it each record it
writes to OUT/metrics.jsonl; its numbers go out at the record's step (each rank's timings as
``rank1/compute_s``) through the tracker's own library, and the run's config becomes the
tracker run's parameters. Each tracker sends from a thread of its own, so a slow or vanished
server never holds a step up; its first error turns it off with one warning line.

Records are numbered (step, index within the step): a step's line and the lines of values
logged between steps share a step, and a name already sent at a step is not sent again at it
(TensorBoard and MLflow would keep both). A resumed run continues each tracker's run (kept in
OUT/trackers.json) from the position the tracker holds, answered so that a kill between a send
and its note repeats nothing:

- TensorBoard: the position noted after each flushed record; the new writer hides events from
  that step on (``purge_step``), and they are sent again.
- MLflow: a run tag sent in the same ``log_batch`` as the metrics: the server's own record.
- W&B: the step its service says comes next (``run.step``): the server's, online; 0 offline,
  where each resumed segment is a run folder that ``wandb sync`` uploads in place of the
  earlier one, so each gets the whole history.
What a tracker lacks from before the resumed step is sent from metrics.jsonl first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0  # at the run's end, how long every tracker together may take to finish sending
_DONE = object()  # a sender's queue ends with it


def check_installed(names: tuple[str, ...]) -> None:
    """A ConfigError for the first tracker whose library is not installed (every rank alike)."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f'trackers: {name} is not installed; pip install "ddpkit[{name}]"')


def scalars(record: dict) -> dict[str, float]:
    """A metrics record's numbers by tracker name; each rank's timings as ``rank{R}/{field}``."""
    values: dict[str, float] = {}
    for key, value in record.items():
        if key == "ranks":
            for row in value:
                values.update({f"rank{row['rank']}/{k}": float(v) for k, v in row.items() if k != "rank"})
        elif key != "step" and isinstance(value, int | float):
            values[key] = float(value)
    return values


def run_params(out: Path, options: dict[str, Any]) -> dict[str, Any]:
    """The tracker run's parameters: ``ddpkit train``'s OUT/config.json, else the Run's options."""
    try:
        saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = None
    sections = saved.values() if isinstance(saved, dict) and {"run", "train"} <= set(saved) else [None]
    if all(isinstance(section, dict) for section in sections):
        return {k: v for section in saved.values() for k, v in section.items()}  # names are unique
    return dict(options)


class Trackers:
    """Rank 0's trackers for one run.

    Args:
        names: the trackers to send to, from ``TRACKERS``.
        out: the run's folder: OUT/trackers.json, OUT/tensorboard, OUT/wandb.
        params: the run's config, flat.
        history: the metrics records already written (a resumed run's, up to its step).
    """

    def __init__(
        self, names: tuple[str, ...], out: Path, params: dict[str, Any], history: list[dict]
    ) -> None:
        self.out, self.params, self.path, self.lock = out, params, out / "trackers.json", threading.Lock()
        try:  # never raise here: only rank 0 would, and the other ranks would wait for it
            self.saved: dict[str, dict] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        except (OSError, ValueError) as exc:
            log.warning("%s cannot be read (%s): the trackers start new runs", self.path, exc)
            self.saved = {}
        self.step, self.index, self.keys = -1, 0, set()  # the last record's place, names sent at its step
        self.senders = [_Sender(_KINDS[name](), self) for name in names]
        for record in history:
            self.write(record)
        for sender in self.senders:
            sender.start()

    def write(self, record: dict) -> None:
        """Queue a metrics record for every tracker still on."""
        step = record["step"]
        if step != self.step:
            self.step, self.index, self.keys = step, 0, set()
        else:
            self.index += 1
        values = {k: v for k, v in scalars(record).items() if k not in self.keys}
        self.keys |= values.keys()
        for sender in self.senders:
            if not sender.failed:
                sender.queue.put((step, self.index, values))

    def note(self, name: str, **values: Any) -> None:
        """Update ``name``'s entry in OUT/trackers.json (atomically: a kill leaves the old or the new)."""
        with self.lock:
            self.saved[name] = {**self.saved.get(name, {}), **values}
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.saved, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)

    def close(self, finished: bool) -> None:
        """Send what is queued and end each tracker's run (finished, or cut short)."""
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for sender in self.senders:
            sender.finished = finished
            sender.queue.put(_DONE)
        for sender in self.senders:
            sender.join(max(0.0, deadline - time.monotonic()))
            if sender.is_alive():
                name, wait = sender.tracker.name, CLOSE_TIMEOUT_S
                log.warning(
                    "tracker %s still sends %.0f s after the run's end and is left behind; OUT/metrics.jsonl "
                    "has every line, and a resumed run sends it what it lacks",
                    name,
                    wait,
                )


class _Sender(threading.Thread):
    """One tracker's thread: opens its run, sends each queued record it lacks, in order."""

    def __init__(self, tracker: Any, owner: Trackers) -> None:
        super().__init__(name=f"ddpkit-{tracker.name}", daemon=True)  # a hung server never blocks exit
        self.tracker, self.owner, self.queue = tracker, owner, queue.SimpleQueue()
        self.failed, self.finished = False, False

    def run(self) -> None:
        tracker, owner = self.tracker, self.owner
        try:
            held = tracker.open(owner, owner.saved.get(tracker.name, {}))
            while (item := self.queue.get()) is not _DONE:
                step, index, values = item
                if (step, index) >= held:
                    held = (step, index + 1)
                    tracker.send(step, values, held)
            tracker.close(self.finished)
        except Exception as exc:  # any failure of a tracker's library: training goes on without it
            self.failed = True
            with contextlib.suppress(Exception):
                tracker.close(False)
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
            log.warning(
                "tracker %s failed and is off for the rest of this run (%s); %s. Training goes on, "
                "and OUT/metrics.jsonl has every line",
                tracker.name,
                reason,
                tracker.fix,
            )


class _TensorBoard:
    name = "tensorboard"
    fix = "check that OUT/tensorboard can be written (disk space, permissions)"

    def open(self, owner: Trackers, saved: dict) -> tuple[int, int]:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.owner, step = owner, saved.get("step", 0)
        self.writer = SummaryWriter(owner.out / "tensorboard", purge_step=step if saved else None)
        if not saved:
            simple = {k: v if isinstance(v, int | float | str) else str(v) for k, v in owner.params.items()}
            for summary in hparams(simple, {}):  # the HPARAMS tab, in this run's own folder
                self.writer._get_file_writer().add_summary(summary)
        owner.note(self.name, log_dir=str(owner.out / "tensorboard"), step=step, records=0)
        return step, 0

    def send(self, step: int, values: dict[str, float], held: tuple[int, int]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # in the file before the note: a note never claims more than the file holds
        self.owner.note(self.name, step=held[0], records=held[1])

    def close(self, finished: bool) -> None:
        self.writer.close()


class _MLflow:
    name = "mlflow"
    fix = "check MLFLOW_TRACKING_URI and that its server is up"
    TAG = "ddpkit_sent"  # "STEP:RECORDS": what this run holds, as the server recorded it
    TOKEN = "ddpkit_token"  # the ddpkit run this MLflow run belongs to (OUT/trackers.json has it)

    def open(self, owner: Trackers, saved: dict) -> tuple[int, int]:
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME

        self.client = MlflowClient()  # MLFLOW_TRACKING_URI, or mlflow's default
        if "run_id" in saved:
            self.run_id = saved["run_id"]
            tag = self.client.get_run(self.run_id).data.tags.get(self.TAG, "0:0")
            self.client.update_run(self.run_id, status="RUNNING")
            return tuple(map(int, tag.split(":")))
        # The run's token is recorded before the run exists and tags it: a kill between creating
        # the run and recording its id leaves a run the next start finds, never a second one.
        token = saved.get("token") or uuid.uuid4().hex
        if "token" not in saved:
            owner.note(self.name, token=token)
        name = MLFLOW_EXPERIMENT_NAME.get() or owner.out.resolve().name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        found = self.client.search_runs([experiment_id], f"tags.{self.TOKEN} = '{token}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {self.TOKEN: token}
            self.run_id = self.client.create_run(
                experiment_id, run_name=owner.out.resolve().name, tags=tags
            ).info.run_id
        params = [Param(k, str(v)) for k, v in owner.params.items()]
        for i in range(0, len(params), 100):  # log_batch takes 100 params at a time
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        owner.note(self.name, run_id=self.run_id)
        tag = self.client.get_run(self.run_id).data.tags.get(self.TAG, "0:0") if found else "0:0"
        return tuple(map(int, tag.split(":")))

    def send(self, step: int, values: dict[str, float], held: tuple[int, int]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, max(len(metrics), 1), 1000):  # and 1000 metrics; the tag goes with the last
            tags = [RunTag(self.TAG, f"{held[0]}:{held[1]}")] if i + 1000 >= len(metrics) else []
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000], tags=tags)

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


class _WandB:
    name = "wandb"
    fix = "check `wandb login` and WANDB_MODE (offline keeps the run in OUT/wandb)"

    def open(self, owner: Trackers, saved: dict) -> tuple[int, int]:
        import wandb
        from wandb.env import get_project

        self.run = wandb.init(
            project=get_project() or "ddpkit",
            dir=str(owner.out),
            name=owner.out.resolve().name,
            id=saved.get("run_id"),
            resume="allow",
            config=owner.params,
            reinit="create_new",  # the user's own wandb run, if any, stays open
        )
        owner.note(self.name, run_id=self.run.id, project=self.run.project)
        return self.run.step, 0  # rows from the step its service says comes next

    def send(self, step: int, values: dict[str, float], held: tuple[int, int]) -> None:
        if values:
            self.run.log(values, step=step)  # a step's records merge into its row

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


_KINDS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}
