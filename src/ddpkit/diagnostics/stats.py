"""Per-rank step statistics: where each rank's time goes, gathered at log steps, stragglers named.

Each rank splits its step time three ways:
- data: fetching and collating its batch;
- compute: forward, the local part of backward, and the optimizer;
- comm wait: from its last locally computed gradient to the end of backward, i.e. waiting for
  the engine's gradient all-reduce. A fast rank waits for a slow one here, so a straggler shows
  as high compute on one rank and high comm wait on all the others.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.dist import DistEnv

log = logging.getLogger(__name__)

FIELDS = ("data_s", "compute_s", "comm_wait_s")
STRAGGLER_RATIO = 1.5  # a rank whose data + compute exceeds this times the others' median is named
MIN_EXCESS_S = 0.05  # ... by at least this many seconds in the window: less is noise, not a straggler


class StepClock:
    """Accumulates one rank's data / compute / comm-wait seconds.

    A post-accumulate-grad hook on every parameter records when the last local gradient was
    ready; the time from there to the end of backward is the wait for communication.

    Args:
        model: the bare model whose parameters get the hook.
    """

    def __init__(self, model: nn.Module) -> None:
        self.totals = dict.fromkeys(FIELDS, 0.0)
        self.last_grad = 0.0
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param: Tensor) -> None:
        self.last_grad = time.perf_counter()

    def add(self, field: str, seconds: float) -> None:
        self.totals[field] += seconds

    def backward_done(self, backward_start: float) -> None:
        """Split a finished backward into local compute and the wait for the all-reduce."""
        end = time.perf_counter()
        ready = min(max(self.last_grad, backward_start), end)
        self.totals["compute_s"] += ready - backward_start
        self.totals["comm_wait_s"] += end - ready


class Window:
    """Loss, samples and timings since the last log line (the loss stays on the device: no sync)."""

    def __init__(self, device: torch.device, clock: StepClock) -> None:
        self.device, self.clock = device, clock
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.samples, self.start = 0, time.perf_counter()
        self.timers_at_start = dict(self.clock.totals)

    def add(self, loss_sum: Tensor, samples: int) -> None:
        self.loss_sum += loss_sum.detach()
        self.samples += samples

    def gather(self, env: DistEnv, flag: float = 0.0) -> tuple[float, int, list[dict]]:
        """Global mean loss, global samples, and each rank's timings. Collective: all ranks call it.

        ``flag`` rides along; the largest any rank sent is left in ``self.max_flag``.
        """
        spent = [self.clock.totals[f] - self.timers_at_start[f] for f in FIELDS]
        mine = torch.tensor(
            [self.loss_sum.item(), float(self.samples), *spent, flag], dtype=torch.float64, device=self.device
        )
        rows = [torch.empty_like(mine) for _ in range(env.world_size)]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu()  # (world_size, 2 + len(FIELDS) + 1)
        ranks = [
            {"rank": r, **{f: round(table[r, 2 + i].item(), 6) for i, f in enumerate(FIELDS)}}
            for r in range(env.world_size)
        ]
        loss_sum, samples = table[:, 0].sum().item(), int(table[:, 1].sum().item())
        self.max_flag = table[:, -1].max().item()
        return loss_sum / max(samples, 1), samples, ranks


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
