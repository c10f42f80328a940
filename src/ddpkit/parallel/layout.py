"""Bucket layouts, and choosing one on the CPU from what the first passes measure.

Where communication is cheap (loopback, a fast link) one bucket is fastest on the CPU: gloo's
copies and sums run on the cores backward uses, so starting early only moves that work, and
every extra collective costs CPU time. Where the link is slow, the all-reduce of one bucket
starts only when backward has ended and the step is compute *plus* communication; buckets of a
few MiB start while backward still runs, and the step approaches forward + max(backward, comm).
Neither can be known at construction (the compute time is not), so the first synchronized
passes try both, alternating, and keep the faster (``LayoutTrial``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.parallel.bucket import CommHook
from ddpkit.parallel.compression import CastHook, PrescaledAllReduce
from ddpkit.parallel.powersgd import PowerSGD

log = logging.getLogger("ddpkit.parallel")

# Split layout: about this many buckets, each between these sizes. Sixteen 1.1 MiB buckets of
# the 4.8M-parameter GPT start its all-reduce after a sixteenth of backward, closer to the ideal
# forward + max(backward, comm) + optimizer than eight larger ones (docs/engine.md, "A slow link",
# measured with ``ddpkit bench engine --link 300mbit``).
SPLIT_BUCKETS = 16
SPLIT_MIN_BYTES = 1024 * 1024
SPLIT_FIRST_BYTES = 256 * 1024  # the first bucket: communication starts after 1/75 of backward
TRIAL_ROUNDS = 3  # passes per layout in the trial
# Synchronized passes until the chosen layout is built: the first (arrival order), the trial's,
# and the one after which the choice is made.
TRIAL_PASSES = 2 + 2 * TRIAL_ROUNDS


@dataclass(frozen=True)
class Layout:
    """How gradients are grouped into buckets (see ``bucket.assign_buckets``).

    Args:
        name: what the log and the benchmark call it.
        first_bytes: size at which the first bucket is closed.
        cap_bytes: size at which every later bucket is closed.
        last_bytes: size of a small last bucket; 0 for none.
    """

    name: str
    first_bytes: int
    cap_bytes: int
    last_bytes: int = 0


def given_layout(first_bytes: int, cap_bytes: int) -> Layout:
    """The layout asked for: a first (and as small a last) bucket of ``first_bytes``, then ``cap_bytes``."""
    small = min(first_bytes, cap_bytes)
    # A small first bucket starts communication early in backward (torch DDP's 1 MiB); a small
    # last bucket shortens the one all-reduce that cannot overlap with backward at all.
    return Layout("given", small, cap_bytes, small if small < cap_bytes else 0)


def split_size(total_bytes: int, cap_bytes: int) -> int:
    """The split layout's bucket size: about total / SPLIT_BUCKETS, at least SPLIT_MIN_BYTES,
    at most ``cap_bytes``."""
    return min(cap_bytes, max(SPLIT_MIN_BYTES, total_bytes // SPLIT_BUCKETS))


def split_layout(total_bytes: int, cap_bytes: int) -> Layout:
    """The split layout for ``total_bytes`` of gradients: a small first bucket, then ``split_size``."""
    size = split_size(total_bytes, cap_bytes)
    return Layout("split", min(size, SPLIT_FIRST_BYTES), size)


def trial_for(
    params: Sequence[nn.Parameter], cap_bytes: int, rounds: int = TRIAL_ROUNDS
) -> LayoutTrial | None:
    """A trial of one bucket against the split layout; None where they would be the same buckets."""
    total = sum(p.numel() * p.element_size() for p in params)
    split = split_layout(total, cap_bytes)
    if split.cap_bytes >= min(total, cap_bytes):
        return None  # a small model or a small cap: the split layout would be the same buckets
    return LayoutTrial((Layout("one", cap_bytes, cap_bytes), split), rounds)


def plan_layout(
    params: Sequence[nn.Parameter], first_bytes: int, cap_bytes: int, auto: bool
) -> tuple[Layout, LayoutTrial | None]:
    """The layout to build first, and the trial that may replace it (``auto``, a large model)."""
    trial = trial_for(params, cap_bytes) if auto else None
    return (trial.candidates[0] if trial else given_layout(first_bytes, cap_bytes)), trial


def broadcast_plan(
    order: list[int], trial: LayoutTrial | None, group: dist.ProcessGroup, device: torch.device
) -> tuple[list[int], int]:
    """Rank 0's bucket order and the trial's next layout, the same on every rank (collectives).

    At the trial's end every rank's fastest passes are reduced first (MAX: a step waits for the slowest
    rank), so the choice is taken on all ranks' timings; rank 0's proposal is the one broadcast.

    Args:
        order: parameter indices in the order the buckets should hold them (rank 0's wins).
        trial: the layout trial when a rebuild of it is due, else None (the layout stays).
        group: the reducer's process group.
        device: where the small messages live (the parameters' device).
    """
    index = 0
    if trial is not None:
        slowest = None
        if trial.deciding:
            fastest = torch.tensor(trial.fastest(), dtype=torch.float64, device=device)
            dist.all_reduce(fastest, op=dist.ReduceOp.MAX, group=group)
            slowest = fastest.tolist()
        index = trial.propose(slowest)
    message = torch.tensor(order + [index], dtype=torch.int64, device=device)
    dist.broadcast(message, group=group, group_src=0)
    *order, index = message.tolist()
    if trial is not None:
        trial.adopt(index, dist.get_rank())
    return order, index


def rebuild_safe(hook: CommHook, trial: LayoutTrial) -> bool:
    """Whether ``hook``'s results do not depend on rebuilds during the trial: ddpkit's own hooks,
    and PowerSGD only while it still sends plain all-reduces (its memory is per bucket)."""
    if isinstance(hook, PowerSGD):
        return hook.start_iter > 2 + len(trial.schedule)
    return isinstance(hook, (PrescaledAllReduce, CastHook))


class LayoutTrial:
    """Tries ``candidates`` in turn over the first passes, then keeps the fastest, once.

    Passes are counted on every rank (also a joined rank's shadow passes), so every rank knows
    when a rebuild is due; which layout comes next is rank 0's choice, broadcast with the
    rebuild (``Reducer.rebuild_buckets``), so all ranks build the same buckets. A pass's time is
    from the end of its forward to the end of its last wait: backward plus the communication
    it did not hide, the only part of a step the layout changes; each layout's fastest pass
    counts, on the slowest rank.

    Args:
        candidates: the layouts to try; the first is kept unless another is faster by ``margin``.
        rounds: passes per candidate.
        margin: how much faster (a fraction) another layout must be to replace the first; a
            shared machine's noise should not flip the default.
    """

    def __init__(self, candidates: tuple[Layout, ...], rounds: int = 3, margin: float = 0.03) -> None:
        assert len(candidates) >= 2 and rounds >= 1, "a layout trial needs two layouts and a round"
        self.candidates, self.rounds, self.margin = candidates, rounds, margin
        # Pass 1 runs on the first candidate and records the arrival order (and allocates: not
        # timed); passes 2 .. 1 + len(schedule) run the schedule; the decision comes after.
        self.schedule = [(k + 1) % len(candidates) for k in range(rounds * len(candidates))]
        self.passes = 0
        self.current = 0  # index into candidates of the layout built now
        self.seconds: list[list[float]] = [[] for _ in candidates]
        self.waits: list[list[float]] = [[] for _ in candidates]  # after the last gradient
        self.chosen: int | None = None
        self.slowest: list[float] = []  # the times the decision was taken on

    def pass_done(self, seconds: float | None, wait: float = 0.0) -> None:
        """A synchronized pass ended: ``seconds`` from its forward's end, ``wait`` of them after its
        last gradient (None: a joined rank's shadow pass)."""
        if self.chosen is None and self.passes >= 1 and seconds is not None:
            self.seconds[self.current].append(seconds)
            self.waits[self.current].append(wait)
        self.passes += 1

    def due(self) -> bool:
        """Whether the buckets are rebuilt before the next pass (the same answer on every rank)."""
        return self.chosen is None and 1 <= self.passes <= len(self.schedule) + 1

    @property
    def deciding(self) -> bool:
        """Whether the next rebuild ends the trial (every rank's times are needed then)."""
        return self.due() and self.passes > len(self.schedule)

    def fastest(self) -> list[float]:
        """This rank's fastest pass per candidate, then its shortest wait after the last gradient
        per candidate (0.0 where none was measured): a busy machine only adds time, so the
        fastest pass is the layout's own cost most nearly."""
        return [min(s) if s else 0.0 for s in self.seconds + self.waits]

    def propose(self, slowest: list[float] | None = None) -> int:
        """Rank 0: the layout for the next pass: the schedule's, or at its end the fastest by
        ``slowest`` (per candidate, the largest of the ranks' fastest passes: a step waits for all)."""
        if not self.deciding:
            return self.schedule[self.passes - 1]
        assert slowest is not None, "the trial's decision needs every rank's times"
        self.slowest = slowest
        times, waits = slowest[: len(self.candidates)], slowest[len(self.candidates) :]
        best = min(range(len(times)), key=times.__getitem__)
        gain = times[0] - times[best]
        # No layout can save more than the first one leaves unhidden after backward: a larger
        # gain is load on the machine, not the layout (1.5: that wait is noisy too).
        return best if self.margin * times[0] < gain <= 1.5 * waits[0] else 0

    def adopt(self, index: int, rank: int) -> None:
        """Build ``index`` from now on; the trial ends when the schedule is done (logged once)."""
        assert 0 <= index < len(self.candidates), f"layout {index} of {len(self.candidates)}"
        self.current = index
        if self.passes > len(self.schedule):
            self.chosen = index
            if rank == 0:
                log.info("DataParallel chose the bucket layout: %s", self.describe())

    def describe(self) -> str:
        """The outcome in one line: each layout's time and which was kept."""
        parts = []
        for k, layout in enumerate(self.candidates):
            seconds = self.slowest[k] if self.slowest else 0.0
            took = f"{1e3 * seconds:.0f} ms" if seconds else "not measured"
            mark = " (kept)" if k == self.chosen else ""
            first = f"{_mib(layout.first_bytes)} first, " if layout.first_bytes < layout.cap_bytes else ""
            parts.append(f"{layout.name} ({first}{_mib(layout.cap_bytes)} buckets) {took}{mark}")
        how = f"backward + unhidden communication, fastest of {self.rounds} passes on the slowest rank"
        waited = self.slowest[len(self.candidates)] if self.slowest else 0.0
        tail = f"; {self.candidates[0].name} waited {1e3 * waited:.0f} ms after backward"
        return ", ".join(parts) + "; " + how + tail


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB"
