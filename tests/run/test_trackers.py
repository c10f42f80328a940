"""Trackers (DiagnosticsConfig.trackers) read back through each tracker's own reader.

TensorBoard's EventAccumulator, W&B's offline run folder (its .wandb file, read with W&B's own
protobuf records) and a real `mlflow server` on loopback queried with MlflowClient: every
metrics line once at its step across a resume, the run's config as parameters. A resumed run
redoes the steps after its checkpoint, so a tracker that got them before the kill must not get
them twice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import ddpkit_cli, wait_unlocked
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.run.monitor.trackers import run_params
from ddpkit.train.command import parse

SCRIPT = Path(__file__).with_name("trackers_script.py")


def _train(out: Path, trackers: list[str]) -> None:
    """3 epochs of 5 steps, a line each (with ``acc``), ``val`` between epochs, a checkpoint every 5."""
    run = ddpkit.Run(out=out, global_batch=8, progress=False, log_every=1, save_every=5, trackers=trackers)
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(40, 6, generator=gen), torch.randn(40, 2, generator=gen))
    model = run.setup(nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    loader = run.loader(data)
    for epoch in range(loader.epoch, 3):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            run.backward(loss)
            optimizer.step()
            run.log(acc=loss.item() / 2)
        run.log(val=float(epoch))
    run.finish()


def _redo_after_step_10(out: Path) -> None:
    """As if killed after step 15's lines reached the trackers but before its checkpoint: the
    resumed run starts at step 10 and redoes 11..15."""
    shutil.rmtree(out / "checkpoints" / "step-00000015")


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _expect(lines: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``name`` over the metrics lines that hold it, in order."""
    return [r["step"] for r in lines if name in r], [r[name] for r in lines if name in r]


def _assert_every_line_once(got: dict[str, tuple[list[int], list[float]]], lines: list[dict]) -> None:
    """Each of loss (step lines), val (between-steps lines) and acc at each line's step, once; and
    no name twice at a step (``epoch`` is in a step's line and its between-steps line)."""
    for name, (steps, _) in got.items():
        assert len(set(steps)) == len(steps), f"{name} at a step twice: {steps}"
    for name in ("loss", "val", "acc"):
        steps, values = _expect(lines, name)
        assert got[name][0] == steps, name
        assert got[name][1] == pytest.approx(values, rel=1e-6), name  # TensorBoard keeps float32


def _tensorboard(out: Path) -> dict[str, tuple[list[int], list[float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    return {tag: ([e.step for e in got], [e.value for e in got]) for tag, got in scalars.items()}


def test_tensorboard_gets_every_line_once_across_a_resume(tmp_path):
    out = tmp_path / "run"
    _train(out, ["tensorboard"])
    _redo_after_step_10(out)
    # ... with TensorBoard's last note at step 8 (it flushed later steps, but no note of them was
    # written): the resumed writer hides events from step 8 on (purge_step) and sends them again,
    # 8-10 from metrics.jsonl, 11-15 as the resumed run redoes them.
    saved = json.loads((out / "trackers.json").read_text())
    saved["tensorboard"].update(step=8, records=0)
    (out / "trackers.json").write_text(json.dumps(saved))
    _train(out, ["tensorboard"])
    scalars, lines = _tensorboard(out), _lines(out)
    _assert_every_line_once(scalars, lines)
    assert scalars["rank0/compute_s"][0] == _expect(lines, "loss")[0]  # the per-rank split too
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one folder, two files


def _wandb_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_SERVICE", raising=False)  # wandb.init sets it for child processes


def _wandb_records(folder: Path):
    """The records of an offline run's .wandb file: W&B's log format (a 7-byte header, then
    32 KiB blocks of chunks: crc32, length, type full/first/middle/last), each a Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = folder.glob("*.wandb")
    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length, kind) == (0, 0):  # the block's padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_run(folder: Path) -> tuple[dict[str, tuple[list[int], list[float]]], dict]:
    """(history by name, config) of an offline W&B run folder."""
    history: dict[str, tuple[list[int], list[float]]] = {}
    config: dict = {}
    for record in _wandb_records(folder):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
            for name, value in row.items():
                history.setdefault(name, ([], []))[0].append(row["_step"])
                history[name][1].append(value)
        elif kind in ("run", "config"):
            items = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in items})
    return history, config


@pytest.mark.slow
def test_wandb_offline_folder_holds_every_line_once_across_a_resume(tmp_path, monkeypatch):
    import wandb

    _wandb_env(monkeypatch, tmp_path)
    out = tmp_path / "run"
    try:
        _train(out, ["wandb"])
        _redo_after_step_10(out)
        _train(out, ["wandb"])
    finally:
        wandb.teardown()  # its service process
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]["run_id"]
    first, resumed = sorted((out / "wandb").glob("offline-run-*"))
    assert first.name.endswith(run_id) and resumed.name.endswith(run_id)  # one W&B run, two segments
    # `wandb sync` uploads the resumed segment in place of the first: it holds the whole run.
    history, config = _wandb_run(resumed)
    _assert_every_line_once(history, _lines(out))
    assert config["global_batch"] == 8 and config["trackers"] == ["wandb"]  # the Run's options


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_tracker_that_fails_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    closed = _free_port()  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once, not after minutes
    out = tmp_path / "run"
    _train(out, ["mlflow", "tensorboard"])
    failed = [line for line in capsys.readouterr().err.splitlines() if "tracker mlflow failed" in line]
    assert len(failed) == 1, failed
    assert "WARNING" in failed[0] and f"127.0.0.1:{closed}" in failed[0]  # the error...
    assert "check MLFLOW_TRACKING_URI" in failed[0]  # ... and the fix
    lines = _lines(out)
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 10, 11, 12, 13, 14, 15, 15]
    _assert_every_line_once(_tensorboard(out), lines)  # the other tracker got everything
    assert (out / "model.pt").exists()


def test_an_unknown_tracker_is_one_line_naming_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        ddpkit.Run(out=tmp_path, trackers=["tensorbored"])
    assert str(info.value) == "unknown tracker 'tensorbored'; choose from tensorboard, mlflow, wandb"


def test_a_missing_library_is_one_line_naming_its_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError) as info:
        ddpkit.Run(out=tmp_path, trackers=("tensorboard", "wandb"))
    assert str(info.value) == 'trackers: wandb is not installed; pip install "ddpkit[wandb]"'


@pytest.mark.slow
def test_ddpkit_train_takes_trackers_and_sends_its_config_json(tmp_path):
    out = tmp_path / "run"
    cfg, _ = parse(["toy", "--trackers", "tensorboard,wandb", "--out", str(out)])
    assert cfg.diagnostics.trackers == ("tensorboard", "wandb")
    out.mkdir()
    (out / "config.json").write_text(cfg.to_json())
    params = run_params(out, {"global_batch": 1})  # the Run's options yield to config.json
    assert params["task"] == "toy" and params["trackers"] == ["tensorboard", "wandb"]
    assert params["global_batch"] == cfg.data.global_batch


# --- a real MLflow server, and a 2-process job killed and resumed with all three trackers ------------


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a free loopback port, sqlite under tmp_path; stopped with its workers."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
        "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--default-artifact-root", str(tmp_path / "artifacts"),
    ]  # fmt: skip
    log = open(tmp_path / "mlflow-server.log", "w")  # noqa: SIM115
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _answers(f"{uri}/health") or server.poll() is not None, 120, "mlflow server")
        assert server.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
        yield uri
    finally:
        # The server, its worker and job runner: nothing of them is needed, and SIGTERM's graceful
        # shutdown takes seconds.
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.1)


def _job(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "--standalone",
        "--nproc",
        "2",
        str(SCRIPT),
        "--out",
        str(out),
        *extra,
    ]


def _mlflow_history(client, out: Path, name: str) -> tuple[list[int], list[float]]:
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    got = sorted(client.get_metric_history(run_id, name), key=lambda m: (m.step, m.timestamp))
    return [m.step for m in got], [m.value for m in got]


@pytest.mark.slow
def test_three_trackers_get_every_line_once_across_a_kill_and_resume_on_two_processes(
    tmp_path, monkeypatch, mlflow_server
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    _wandb_env(monkeypatch, tmp_path)
    out = tmp_path / "job"

    def trackers_hold(step: int) -> bool:  # MLflow and TensorBoard got the line of ``step``
        try:
            noted = json.loads((out / "trackers.json").read_text())["tensorboard"]["step"]
            return noted >= step and max(_mlflow_history(client, out, "loss")[0]) >= step
        except (OSError, ValueError, KeyError):
            return False

    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    job = subprocess.Popen(_job(out, "--hold-at", "28"), **quiet, start_new_session=True)
    try:  # lines up to 25 sent, past the checkpoint at 20: the resumed run redoes them
        from mlflow import MlflowClient  # seconds to import: while the job starts

        client = MlflowClient(mlflow_server)
        _wait_for(lambda: trackers_hold(25) or job.poll() is not None, 180, "the trackers' line of step 25")
        assert job.poll() is None, f"the job ended (exit {job.returncode}) before it was killed"
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert wait_unlocked(out), f"a process of the killed job still holds {out}"
    done = ddpkit_cli(_job(out), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "step-00000020" in done.stdout
    assert "failed and is off" not in done.stderr  # no tracker failed

    lines = _lines(out)
    assert [r["step"] for r in lines if "val" in r] == [8, 16, 24, 32, 40]
    saved = json.loads((out / "trackers.json").read_text())
    run = client.get_run(saved["mlflow"]["run_id"])
    got = {name: _mlflow_history(client, out, name) for name in run.data.metrics}
    _assert_every_line_once(got, lines)
    assert got["rank1/compute_s"][0] == _expect(lines, "loss")[0]
    assert run.info.status == "FINISHED" and run.data.params["global_batch"] == "8"
    experiment = client.get_experiment_by_name("job")  # named after the out folder
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run.info.run_id]

    _assert_every_line_once(_tensorboard(out), lines)
    history, _ = _wandb_run(sorted((out / "wandb").glob("offline-run-*"))[-1])
    _assert_every_line_once(history, lines)


class _Interrupted(Exception):
    """Stands in for a kill right after MLflow created the run, before its id was recorded."""


@pytest.mark.slow
def test_a_kill_between_creating_the_mlflow_run_and_recording_it_leaves_one_run(tmp_path, monkeypatch):
    # Seen 1 in 5 kills under load: a second MLflow run, the first stuck RUNNING.
    from mlflow import MlflowClient

    from ddpkit.run.monitor.trackers import _MLflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = tmp_path / "out"
    out.mkdir()
    noted: dict = {}

    class Owner:  # what a tracker reads of ddpkit's Trackers: the folder, the params, the record
        params = {"global_batch": 8}

        def note(self, name: str, **values) -> None:
            if "run_id" in values and not noted.get("survived"):
                raise _Interrupted  # killed before the id reached OUT/trackers.json
            noted.update(values)

    Owner.out = out
    with pytest.raises(_Interrupted):
        _MLflow().open(Owner(), {})
    noted["survived"] = True
    again = _MLflow()
    assert again.open(Owner(), {"token": noted["token"]}) == (0, 0)
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    assert [run.info.run_id for run in runs] == [again.run_id] == [noted["run_id"]]
