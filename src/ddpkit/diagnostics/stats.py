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
from collections import deque

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)

FIELDS = ("data_s", "compute_s", "comm_wait_s")
STRAGGLER_RATIO = 1.5  # a rank whose data + compute exceeds this times the others' median is named
MIN_EXCESS_S = 0.05  # ... by at least this many seconds in the window: less is noise, not a straggler
FOLD_LOSSES = 256  # a window's losses are summed on the device once this many are pending
STEP_TIMES = 1024  # a window's median step is over at most its last this many steps


class StepClock:
    """Accumulates one rank's data and comm-wait seconds; compute is the rest of a window's time.

    One post-accumulate-grad hook per watched model, on its first trainable parameter, queues a
    callback on the autograd engine that runs once the whole backward graph is done: every local
    gradient is computed, and the engines' own end-of-backward callbacks (queued later, as the
    last gradient arrives), which wait for the all-reduce, have not run yet. The time from there
    to the end of backward is the wait for communication. A Python hook on every parameter would
    cost about a microsecond each per step. A backward that gives that parameter no gradient
    (unused this step) counts its whole time as compute; one inside a reentrant activation
    checkpoint ends the inner graph, which shows as comm wait.
    """

    def __init__(self) -> None:
        self.data_s = self.comm_wait_s = 0.0
        self._graph_done = 0.0
        self._queued = False

    def watch(self, model: nn.Module) -> None:
        """Time the backward passes through ``model`` (before an engine wraps it: its own hooks,
        registered later on the same parameter, then run after this one)."""
        first = next((p for p in model.parameters() if p.requires_grad), None)
        if first is not None:
            first.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param: Tensor) -> None:
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._graph_end)

    def _graph_end(self) -> None:
        self._graph_done = time.perf_counter()

    def backward_begins(self) -> float:
        """Before a ``loss.backward()``: its start, to hand to ``backward_ended``."""
        self._graph_done, self._queued = 0.0, False
        return time.perf_counter()

    def backward_ended(self, start: float) -> None:
        """After the ``loss.backward()`` that began at ``start``: its time after the local
        gradients were done counts as comm wait."""
        if self._graph_done:
            end = time.perf_counter()
            self.comm_wait_s += end - min(max(self._graph_done, start), end)


class Window:
    """Loss, samples and timings since the last log line (the loss stays on the device: no sync)."""

    def __init__(self, device: torch.device, clock: StepClock) -> None:
        self.device, self.clock = device, clock
        self.last_end = time.perf_counter()  # when the last step ended (or the loop began)
        self.reset()

    def reset(self) -> None:
        self._loss_sum = torch.zeros(2, dtype=torch.float64, device=self.device)  # (sum, weight)
        self._losses: list[Tensor] = []  # each backward's loss, still on the device
        self._weights: list[float] = []  # ... what it is multiplied by in the line's sum
        self._denoms: list[float | Tensor] = []  # ... and what it adds to the line's denominator
        self.samples, self.tokens, self.start = 0, 0, time.perf_counter()
        self.step_s: deque[float] = deque(maxlen=STEP_TIMES)  # the last steps' seconds, end to end
        self._at_start = (self.clock.data_s, self.clock.comm_wait_s)

    def add_loss(self, loss: Tensor, weight: float, denom: float | Tensor) -> None:
        """Count a backward's loss as ``weight x loss`` over ``denom`` (no host sync): a micro-batch's
        mean counts as samples x mean over samples, a token sum as the sum over its token count.
        Appending costs less than adding."""
        loss = loss.detach()
        if loss.dim():
            if loss.numel() != 1:
                raise ConfigError(
                    f"run.backward takes a micro-batch's loss, one number; got shape "
                    f"{tuple(loss.shape)}: reduce it first, e.g. loss.mean()"
                )
            loss = loss.reshape(())
        self._losses.append(loss)
        self._weights.append(weight)
        self._denoms.append(denom)
        if len(self._losses) == FOLD_LOSSES:
            self._fold()

    def loss_sum(self) -> Tensor:
        """(2,) float64 on the device: the window's weighted loss sum and its denominator."""
        self._fold()
        return self._loss_sum

    def _fold(self) -> None:
        if self._losses:
            weights = torch.tensor(self._weights, dtype=torch.float64).to(self.device, non_blocking=True)
            self._loss_sum[0] += torch.stack(self._losses).double() @ weights
            numbers = [d for d in self._denoms if not isinstance(d, Tensor)]
            tensors = [d.detach().reshape(()).double() for d in self._denoms if isinstance(d, Tensor)]
            self._loss_sum[1] += sum(numbers)
            if tensors:
                self._loss_sum[1] += torch.stack(tensors).to(self.device).sum()
            self._losses, self._weights, self._denoms = [], [], []

    def step_ended(self) -> None:
        now = time.perf_counter()
        self.step_s.append(now - self.last_end)
        self.last_end = now

    def median_step_s(self) -> float:
        """The window's (last steps') median step: unlike its mean, blind to a pause between two."""
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
