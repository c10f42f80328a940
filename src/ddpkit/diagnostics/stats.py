"""Per-rank step statistics: where each rank's time goes, gathered at log steps, stragglers named.

Each rank splits its step time three ways:
- data: fetching and collating its batch;
- compute: the rest of the window: forward, the local part of backward, the optimizer, and
  whatever else the loop does between batches;
- comm wait: from its last locally computed gradient to the end of backward, i.e. waiting for
  the engine's gradient all-reduce. A fast rank waits for a slow one here, so a straggler shows
  as high compute on one rank and high comm wait on all the others.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

FIELDS = ("data_s", "compute_s", "comm_wait_s")
STRAGGLER_RATIO = 1.5  # a rank whose data + compute exceeds this times the others' median is named
MIN_EXCESS_S = 0.05  # ... by at least this many seconds in the window: less is noise, not a straggler


class StepClock:
    """Accumulates one rank's data and comm-wait seconds; compute is the rest of a window's time.

    A post-accumulate-grad hook on every watched parameter records when the last local gradient
    was ready; the time from there to the end of backward is the wait for communication.
    """

    def __init__(self) -> None:
        self.data_s = self.comm_wait_s = 0.0
        self.last_grad = 0.0

    def watch(self, model: nn.Module) -> None:
        """Time backward's local part on this model's trainable parameters."""
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param: Tensor) -> None:
        self.last_grad = time.perf_counter()

    def backward_done(self, backward_start: float) -> None:
        """A backward that began at ``backward_start`` ended now: add its wait for the all-reduce."""
        end = time.perf_counter()
        self.comm_wait_s += end - min(max(self.last_grad, backward_start), end)


class Window:
    """Loss, samples and timings since the last log line (the loss stays on the device: no sync)."""

    def __init__(self, device: torch.device, clock: StepClock) -> None:
        self.device, self.clock = device, clock
        self.last_end = time.perf_counter()  # when the last step ended (or the loop began)
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.samples, self.start = 0, time.perf_counter()
        self.step_s: list[float] = []  # each step's seconds, end to end
        self._at_start = (self.clock.data_s, self.clock.comm_wait_s)

    def step_ended(self) -> None:
        now = time.perf_counter()
        self.step_s.append(now - self.last_end)
        self.last_end = now

    def median_step_s(self) -> float:
        """The window's median step: unlike its mean, blind to a pause between two steps."""
        return statistics.median(self.step_s) if self.step_s else 0.0

    def spent(self, now: float) -> tuple[float, ...]:
        """Seconds of data, compute and comm wait since the window began (in FIELDS order)."""
        data = self.clock.data_s - self._at_start[0]
        comm_wait = self.clock.comm_wait_s - self._at_start[1]
        return data, max(0.0, now - self.start - data - comm_wait), comm_wait


def stragglers(
    ranks: list[dict], ratio: float = STRAGGLER_RATIO, min_excess_s: float = MIN_EXCESS_S
) -> list[tuple[int, float]]:
    """Ranks whose own work (data + compute) exceeds ``ratio`` times the median of the other ranks.

    Against the others' median, not everyone's: with 2 ranks the median includes the slow rank
    itself and no factor could ever reach 2x. Excesses under ``min_excess_s`` are scheduling noise.
    """
    work = [r["data_s"] + r["compute_s"] for r in ranks]
    slow = []
    for i, (row, mine) in enumerate(zip(ranks, work, strict=True)):
        others = work[:i] + work[i + 1 :]
        median = statistics.median(others) if others else 0.0
        if median > 0 and mine > ratio * median and mine - median >= min_excess_s:
            slow.append((row["rank"], mine / median))
    return slow


def rank_table(step: int, ranks: list[dict]) -> str:
    """A fixed-width table of each rank's seconds over the last window."""
    lines = [
        f"step {step}: seconds per rank since the last log line",
        "  rank    data_s  compute_s  comm_wait_s",
    ]
    lines += [
        f"  {r['rank']:>4}  {r['data_s']:8.3f}  {r['compute_s']:9.3f}  {r['comm_wait_s']:11.3f}"
        for r in ranks
    ]
    return "\n".join(lines)
