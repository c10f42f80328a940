"""Diagnostics a Run gives the user's loop by default: timings per rank, log lines, progress, hangs.

Every rank measures where its step time goes (data, compute, waiting for the gradient
all-reduce). At log steps all ranks gather those timings, the loss, their run.log values and
whether a preemption signal arrived in one background collective (``ddpkit.run.monitor.log_gather``),
finished at the next step's end; rank 0 then writes OUT/metrics.jsonl, sends the line to the
trackers, moves the progress bar and names stragglers. The hang watchdog is told the phase of
each collective-bearing part of a step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from ddpkit.diagnostics import HangWatchdog
from ddpkit.diagnostics.stats import StepClock, Window, rank_table, stragglers
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.config import DiagnosticsConfig
from ddpkit.run.monitor.log_gather import LogGather, device_peak, gather_means
from ddpkit.run.monitor.metrics import MetricsLog, plot_loss, read_metrics, truncate_after
from ddpkit.run.monitor.trackers import Trackers, check_installed, run_params

log = logging.getLogger(__name__)

# By default, log lines and replica checks come every so many steps: the first of these choices
# that lasts the interval by the measured step time.
LOG_EVERY, LOG_INTERVAL_S = (10, 20, 50, 100, 200, 500, 1000), 0.1  # about tqdm's redraw
STRAGGLER_WINDOWS, STRAGGLER_EVERY_S = 3, 300.0
CHECK_EVERY, CHECK_INTERVAL_S = (100, 200, 500, 1000, 2000, 5000, 10000), 1.0


def paced_every(seconds_per_step: float, choices: tuple[int, ...], interval_s: float) -> int:
    """The first of ``choices`` (steps) that lasts ``interval_s``; the last choice at most.

    ``seconds_per_step`` comes from gathered timings, so every rank picks the same number.
    """
    return next((n for n in choices if n * seconds_per_step >= interval_s), choices[-1])


class Monitor:
    """One rank's timings, loss window and user metrics, and rank 0's outputs.

    Args:
        env: this process's distributed environment.
        cfg: what to watch and how often.
        out: the run's folder (None: no files).
        params: the run's config, flat, for the trackers' runs.
    """

    def __init__(
        self, env: DistEnv, cfg: DiagnosticsConfig, out: Path | None, params: dict | None = None
    ) -> None:
        check_installed(cfg.trackers)  # on every rank, so all stop alike
        self.env, self.cfg, self.out, self.params = env, cfg, out, params or {}
        self.trackers: Trackers | None = None  # rank 0's, once the loop starts
        self.clock = StepClock()
        self.window = Window(env.device, self.clock)
        self.user: dict[str, list[float]] = {}  # run.log in a step: name -> [sum, count]
        self.between: dict[str, list[float]] = {}  # run.log between steps: name -> [sum, count]
        self.bar: tqdm | None = None
        self.metrics = MetricsLog(out / "metrics.jsonl") if out is not None and env.is_rank0 else None
        self.watchdog: HangWatchdog | None = None
        if cfg.collective_timeout and env.world_size > 1:  # one process cannot wait for another
            report = out / "hang-report.txt" if out is not None else None
            self.watchdog = HangWatchdog(
                env,
                cfg.collective_timeout,
                report_path=report,
                desync_s=cfg.desync_timeout,
                startup_s=cfg.startup_timeout,
            ).start()
        self.start_step = self.logged_step = -1
        self.every = cfg.log_every or LOG_EVERY[0]  # steps between log lines, for now
        # ... and between replica checks (0: none)
        self.check_every = CHECK_EVERY[0] if cfg.check_every is None else cfg.check_every
        # The last log step's gather, still in flight.
        self.gather = LogGather(env, cfg.flops_per_sample, device_peak(env.device, cfg.peak_flops))
        self.last_loss: float | None = None  # the loss of the last metrics line finished
        self.slow_streak: dict[int, int] = {}  # rank -> log windows in a row it was a straggler in
        self.warned: dict[int, float] = {}  # rank -> when it was last called one

    def _truncate_samples(self, step: int) -> None:
        # A resumed run (maybe at another world size) redoes the steps after its checkpoint:
        # drop them from every rank's log, including ranks this run no longer has.
        folder = self.out / "samples"
        if self.env.is_rank0:
            folder.mkdir(parents=True, exist_ok=True)
            for path in folder.glob("rank*.jsonl"):
                truncate_after(path, step)
        dist.barrier()  # no rank appends before rank 0 has truncated

    def pace(self, seconds_per_step: float) -> None:
        """Re-pace default log lines and checks from the slowest rank's step (the same on every rank)."""
        if self.cfg.log_every is None:
            self.every = paced_every(seconds_per_step, LOG_EVERY, LOG_INTERVAL_S)
        if self.cfg.check_every is None:
            self.check_every = paced_every(seconds_per_step, CHECK_EVERY, CHECK_INTERVAL_S)

    def watch(self, model: nn.Module) -> None:
        """Time backward's local part through this bare model (for the comm-wait split)."""
        self.clock.watch(model)

    def phase(self, step: int, name: str) -> None:
        if self.watchdog is not None:
            self.watchdog.phase(step, name)

    def start(self, step: int, total: int | None) -> None:
        """The loop begins (at ``step`` after a resume): drop metrics a resumed run will redo."""
        if self.metrics is not None:
            truncate_after(self.metrics.path, step)
            if self.cfg.trackers:  # sent what they lack of the lines up to ``step`` first
                history = read_metrics(self.metrics.path) if self.metrics.path.exists() else []
                params = run_params(self.out, self.params)
                self.trackers = Trackers(self.cfg.trackers, self.out, params, history)
        if self.cfg.log_samples and self.out is not None:
            self._truncate_samples(step)
        show = self.env.is_rank0 and self.cfg.progress
        if show and any(not bar.disable for bar in list(tqdm._instances)):
            # The user's own bar (tqdm(loader), an epoch bar) is open: two bars would interleave.
            log.info("your own progress bar is open, so ddpkit shows none (progress=False says so)")
            show = False
        self.bar = tqdm(total=total, initial=step, unit="step", dynamic_ncols=True, disable=not show)
        self.window.reset()
        self.window.last_end = self.window.start
        self.start_step = self.logged_step = step

    def epoch_started(self, epoch: int, done: int, per_epoch: int, steps: int | None) -> None:
        """An epoch's loop begins with ``done`` of its ``per_epoch`` steps taken: the bar counts the
        epoch's steps, or the run's when it has a step limit."""
        if self.bar is None or self.bar.disable:
            return
        if steps is None:
            self.bar.reset(total=per_epoch)
            # The rate counts this process's steps: tqdm's is (n - initial) / elapsed, and a
            # resumed run's initial (its step) would make the first frame's rate negative.
            self.bar.initial = self.bar.n = self.bar.last_print_n = done
        self.bar.set_description(f"epoch {epoch}", refresh=False)

    def samples_taken(self, step: int, indices: list[int]) -> None:
        """Append this rank's indices of ``step`` to OUT/samples/rank{R}.jsonl (with log_samples)."""
        if self.cfg.log_samples and self.out is not None:
            with open(self.out / "samples" / f"rank{self.env.rank}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "indices": indices}) + "\n")

    def data(self, seconds: float) -> None:
        """Seconds the loop waited for its data (a batch, a stream's agreement)."""
        self.clock.data_s += seconds

    def micro_batch(self, samples: int, tokens: int = 0) -> None:
        """A micro-batch of ``samples`` samples (and ``tokens`` tokens) that count enters the loop."""
        self.window.samples += samples
        self.window.tokens += tokens

    def loss(self, loss: Tensor, weight: float, denom: float | Tensor) -> None:
        """A backward's loss, for the metrics line: ``weight x loss`` over ``denom`` (see Window)."""
        self.window.add_loss(loss, weight, denom)

    def add_user(self, name: str, value: float | Tensor, weight: float, reduce: str, step: int) -> None:
        """A run.log value, weighted by the samples behind it: for the window's line, or (``step``
        -1: between steps) for a line of its own. See ``gather_means``."""
        if reduce not in ("mean", "sum"):
            raise ConfigError(
                f"run.log(reduce={reduce!r}): use 'mean' (weighted by samples) or 'sum' (counts)"
            )
        if not isinstance(value, int | float | Tensor) or isinstance(value, bool):
            raise ConfigError(
                f"run.log({name}={value!r}): a metric is a number or a one-element tensor; log "
                "text with run.print"
            )
        entry = (self.between if step < 0 else self.user).setdefault(name, [0.0, 0.0, reduce, set()])
        if entry[2] != reduce:
            raise ConfigError(
                f"run.log({name}=...) was logged with reduce={entry[2]!r} and {reduce!r}; use one"
            )
        value = value.detach().double() if isinstance(value, Tensor) else float(value)
        # A sum counts every value with samples behind it; a mean weighs each by its samples.
        entry[0] += value * weight if reduce == "mean" else value * (weight > 0)
        entry[1] += weight
        entry[3].add(step)

    def step_ended(self) -> None:
        """A step's last micro-batch is done; its collectives come at the next step boundary."""
        self.window.step_ended()
        if self.watchdog is not None:
            self.watchdog.steady()  # the first step ended: the collective timeout applies
        if self.bar is not None:
            self.bar.update(1)

    def step_done(
        self, step: int, ended: bool, last: bool, extra: dict, signal: int = 0
    ) -> tuple[tuple[dict, int] | None, bool]:
        """At the boundary after a step (``ended``), or at the run's end: start this step's log
        gather when due (its line gets ``extra``: epoch, rate), and finish the previous one.
        Returns the finished one's record and the largest preemption ``signal`` any rank sent
        with it (or None), and whether this step's gather started now (the signal rides on it).
        Collective when due: every rank reaches the same steps."""
        logged = self._finish_gather() if self.gather.pending is not None else None
        due = ended and (step % self.every == 0 or step == 1)
        gathering = (due or last) and step != self.logged_step and step != self.start_step
        if gathering:
            self._start_gather(step, extra, signal)
            if last:  # nothing follows to finish it
                logged = self._finish_gather()
        return logged, gathering

    def flush(self) -> None:
        """Write the log line still in flight, when every rank is known to wait for it too (a
        preemption every rank agreed on); the resumed run continues after that line."""
        if self.gather.pending is not None:
            self._finish_gather()

    def flush_between(self, step: int, extra: dict) -> None:
        """Gather what any rank logged between steps and write it as a line of ``step``: each value
        once, never mixed with another epoch's. Collective: every rank calls it at the same point."""
        self.flush()  # the last step's own line first
        self.phase(step, "log: metrics logged between steps, all_gather_object")
        means, self.between = gather_means(self.env, self.between), {}
        if means and self.metrics is not None:
            self._write({"step": step, **extra, **means})
        if means and self.bar is not None:
            self.bar.set_postfix(means, refresh=False)

    def _start_gather(self, step: int, extra: dict, signal: int) -> None:
        self.phase(step, "log: loss, timings and metrics all_gather")
        self.gather.start(step, self.window, self.user, extra, signal)
        self.user = {}
        self.window.reset()
        self.logged_step = step

    def _finish_gather(self) -> tuple[dict, int]:
        self.phase(self.gather.pending.step, "log: loss, timings and metrics all_gather")
        record, signal = self.gather.finish()
        self.last_loss = record["loss"]  # run.loss, on every rank: the rows came from every rank
        if self.env.is_rank0:
            self._report(record["step"], record)
        return record, signal

    def _write(self, record: dict) -> None:
        self.metrics.write(record)
        if self.trackers is not None:
            self.trackers.write(record)

    def _report(self, step: int, record: dict) -> None:
        if self.metrics is not None:
            self._write(record)
        if self.bar is not None:
            speed = {"tok/s": f"{record['tokens_per_s']:.0f}"} if "tokens_per_s" in record else {}
            speed |= {"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", **speed, refresh=False)
        if self.cfg.rank_table_every and step % self.cfg.rank_table_every == 0:
            log.info("%s", rank_table(step, record["ranks"]))
        slow = dict(stragglers(record["ranks"]))
        self.slow_streak = {rank: self.slow_streak.get(rank, 0) + 1 for rank in slow}
        for rank, factor in slow.items():
            # Slow in STRAGGLER_WINDOWS log windows in a row, said at most every STRAGGLER_EVERY_S
            # per rank: one slow window is a shared machine's noise; ddpkit report keeps them all.
            now = time.monotonic()
            if (
                self.slow_streak[rank] >= STRAGGLER_WINDOWS
                and now - self.warned.get(rank, -1e9) >= STRAGGLER_EVERY_S
            ):
                self.warned[rank] = now
                log.warning(
                    "step %d: rank %d is a straggler: data + compute took %.1fx the other ranks' median "
                    "for %d log windows in a row",
                    step,
                    rank,
                    factor,
                    self.slow_streak[rank],
                )

    def close(self, plot: bool) -> None:
        """Stop the watchdog and the bar; on rank 0 draw OUT/loss.png from the whole metrics file.

        A gather still in flight (the loop raised) is dropped, not waited for: a rank that failed
        may never join it."""
        self.gather.pending = None
        if self.metrics is not None:
            self.metrics.close()
        if self.trackers is not None:
            self.trackers.close(finished=plot)  # plot: the run finished
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.bar is not None:
            self.bar.close()
        if plot and self.metrics is not None and self.metrics.path.exists():
            records = [r for r in read_metrics(self.metrics.path) if "loss" in r]
            if records:
                with contextlib.suppress(OSError):
                    plot_loss(records, self.out / "loss.png")
