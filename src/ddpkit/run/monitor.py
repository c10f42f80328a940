"""Diagnostics a Run gives the user's loop by default: timings per rank, log lines, progress, hangs.

Every rank measures where its step time goes (data, compute, waiting for the gradient
all-reduce). At log steps all ranks gather those timings, the loss and the user's metrics in
one collective; rank 0 writes OUT/metrics.jsonl, moves the progress bar and names stragglers.
The hang watchdog is told the phase of each collective-bearing part of a step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from ddpkit.diagnostics import HangWatchdog
from ddpkit.diagnostics.stats import StepClock, Window, rank_table, stragglers
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.metrics import MetricsLog, plot_loss, read_metrics, truncate_after

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiagnosticsConfig:
    """What a Run watches and reports while the user's loop trains.

    Args:
        log_every: gather the loss, timings and user metrics and write a metrics line every
            this many steps (and at step 1 and at the end).
        check_every: every this many steps, all ranks compare parameter fingerprints; 0 disables.
        rank_table_every: rank 0 logs every rank's data / compute / comm-wait seconds this often;
            0 disables (stragglers are warned about regardless).
        collective_timeout: seconds a rank may spend without progress in a collective before the
            watchdog names the ranks that are behind, prints every rank's stack and ends the run;
            0 disables. Generous by default: a slow rank is not a hung one.
        startup_timeout: seconds every rank may take to join the process group (a node still
            pulling its container, a slow import) before start-up fails; after that the
            collective timeout applies.
        progress: show a progress bar on rank 0.
        log_samples: each rank appends the dataset indices of each step to OUT/samples/rank{R}.jsonl.
    """

    log_every: int = 10
    check_every: int = 100
    rank_table_every: int = 0
    collective_timeout: float = 1800.0
    startup_timeout: float = 600.0
    progress: bool = True
    log_samples: bool = False

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ConfigError(f"log_every={self.log_every} is below 1; use a positive number of steps")
        if not 0 < self.startup_timeout < float("inf"):
            raise ConfigError(f"startup_timeout={self.startup_timeout} must be a positive number of seconds")
        for name in ("check_every", "rank_table_every", "collective_timeout"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}={getattr(self, name)} is below 0; use 0 to disable")


class Monitor:
    """One rank's timings, loss window and user metrics, and rank 0's outputs.

    Args:
        env: this process's distributed environment.
        cfg: what to watch and how often.
        out: the run's folder (None: no files).
    """

    def __init__(self, env: DistEnv, cfg: DiagnosticsConfig, out: Path | None) -> None:
        self.env, self.cfg, self.out = env, cfg, out
        self.clock = StepClock(nn.Module())
        self.window = Window(env.device, self.clock)
        self.user: dict[str, list[float]] = {}
        self.bar: tqdm | None = None
        self.metrics = MetricsLog(out / "metrics.jsonl") if out is not None and env.is_rank0 else None
        self.watchdog: HangWatchdog | None = None
        if cfg.collective_timeout and env.world_size > 1:  # one process cannot wait for another
            report = out / "hang-report.txt" if out is not None else None
            self.watchdog = HangWatchdog(env, cfg.collective_timeout, report_path=report).start()
        self.mark = time.perf_counter()  # the end of the last measured interval
        self.start_step = self.logged_step = -1

    def _truncate_samples(self, step: int) -> None:
        # A resumed run (maybe at another world size) redoes the steps after its checkpoint:
        # drop them from every rank's log, including ranks this run no longer has.
        folder = self.out / "samples"
        if self.env.is_rank0:
            folder.mkdir(parents=True, exist_ok=True)
            for path in folder.glob("rank*.jsonl"):
                truncate_after(path, step)
        dist.barrier()  # no rank appends before rank 0 has truncated

    def watch(self, model: nn.Module) -> None:
        """Time backward's local part on this model's parameters (for the comm-wait split)."""
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self.clock._grad_ready)

    def phase(self, step: int, name: str) -> None:
        if self.watchdog is not None:
            self.watchdog.phase(step, name)

    def start(self, step: int, total: int | None) -> None:
        """The loop begins (at ``step`` after a resume): drop metrics a resumed run will redo."""
        if self.metrics is not None:
            truncate_after(self.metrics.path, step)
        if self.cfg.log_samples and self.out is not None:
            self._truncate_samples(step)
        self.bar = tqdm(
            total=total, initial=step, unit="step", dynamic_ncols=True,
            disable=not (self.env.is_rank0 and self.cfg.progress),
        )  # fmt: skip
        self.window.reset()
        self.mark = time.perf_counter()
        self.start_step = self.logged_step = step

    def samples_taken(self, step: int, indices: list[int]) -> None:
        """Append this rank's indices of ``step`` to OUT/samples/rank{R}.jsonl (with log_samples)."""
        if self.cfg.log_samples and self.out is not None:
            with open(self.out / "samples" / f"rank{self.env.rank}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "indices": indices}) + "\n")

    def data(self, start: float) -> None:
        """A batch arrived; the time since ``start`` went to data, the time before it to compute."""
        now = time.perf_counter()
        self.clock.add("compute_s", max(0.0, start - self.mark))
        self.clock.add("data_s", now - start)
        self.mark = now

    def backward(self, start: float) -> None:
        """A backward that began at ``start`` ended: split it into compute and comm wait."""
        self.clock.add("compute_s", max(0.0, start - self.mark))
        self.clock.backward_done(start)
        self.mark = time.perf_counter()

    def add_user(self, name: str, value: float | Tensor) -> None:
        total = self.user.setdefault(name, [0.0, 0])
        total[0] += value.detach().double() if isinstance(value, Tensor) else float(value)
        total[1] += 1

    def step_done(self, step: int, ended: bool, last: bool, extra: Callable[[], dict]) -> dict | None:
        """After a step (``ended``), or at the run's end: a log line when due. Collective when due:
        every rank reaches the same steps, so all agree on it."""
        self.clock.add("compute_s", max(0.0, time.perf_counter() - self.mark))
        self.mark = time.perf_counter()
        if ended and self.bar is not None:
            self.bar.update(1)
        due = ended and (step % self.cfg.log_every == 0 or step == 1)
        if not (due or last) or step == self.logged_step or step == self.start_step:
            return None
        self.phase(step, "log: loss, timings and metrics all_gather")
        record = self._record(step, extra())
        if self.env.is_rank0:
            self._report(step, record)
        self.window.reset()
        self.logged_step, self.mark = step, time.perf_counter()
        return record

    def _record(self, step: int, extra: dict) -> dict:
        # Whether any rank logged metrics rides on the tensor gather, so the pickled gather of their
        # names and values (ranks may have logged different ones) runs only when there are some.
        loss, samples, ranks = self.window.gather(self.env, flag=float(bool(self.user)))
        elapsed = time.perf_counter() - self.window.start
        everyone: list[dict | None] = [{}] * self.env.world_size
        if self.window.max_flag:
            mine = {name: (float(total), count) for name, (total, count) in self.user.items()}
            everyone = [None] * self.env.world_size
            dist.all_gather_object(everyone, mine)
        self.user.clear()
        return {
            "step": step,
            "loss": loss,
            "samples_per_s": samples / elapsed,
            "time_s": elapsed,
            **extra,
            **_means(everyone),
            # Running totals since the run (or its resume) began, per rank: `ddpkit report` sums them.
            "ranks": ranks,
        }

    def _report(self, step: int, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if self.cfg.rank_table_every and step % self.cfg.rank_table_every == 0:
            log.info("%s", rank_table(step, record["ranks"]))
        for rank, factor in stragglers(record["ranks"]):
            log.warning(
                "step %d: rank %d is a straggler: data + compute took %.1fx the other ranks' median",
                step,
                rank,
                factor,
            )

    def close(self, plot: bool) -> None:
        """Stop the watchdog and the bar; on rank 0 draw OUT/loss.png from the whole metrics file."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.bar is not None:
            self.bar.close()
        if plot and self.metrics is not None and self.metrics.path.exists():
            records = [r for r in read_metrics(self.metrics.path) if "loss" in r]
            if records:
                with contextlib.suppress(OSError):
                    plot_loss(records, self.out / "loss.png")


def _means(everyone: list[dict]) -> dict[str, float]:
    """Each user metric's mean over every value any rank logged in the window."""
    totals: dict[str, list[float]] = {}
    for mine in everyone:
        for name, (total, count) in mine.items():
            both = totals.setdefault(name, [0.0, 0])
            both[0] += total
            both[1] += count
    return {name: total / count for name, (total, count) in totals.items()}
