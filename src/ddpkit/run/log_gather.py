"""A log step's collective: every rank's loss, timings and run.log values, gathered into one record.

At a log step each rank puts its window (loss sum, samples, the data / compute / comm-wait split,
its median step, whether it logged metrics, a preemption signal) in one float64 row and starts an
``all_gather`` of the rows without waiting for it; the loop goes on, and the gather is finished at
the next step's end or the run's last step. So a log step costs no wait for the slowest rank and
no device sync. The pickled gather of run.log names and values runs only when some rank logged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.diagnostics.stats import FIELDS, Window
from ddpkit.dist import DistEnv


@dataclass(frozen=True)
class _InFlight:
    """A log step's gather in flight: what its record needs once the rows arrive."""

    step: int
    rows: list[Tensor]
    work: dist.Work
    elapsed: float
    extra: dict
    user: dict[str, list]


class LogGather:
    """Starts a log step's gather and finishes it later into the step's metrics record.

    Args:
        env: this process's distributed environment (the device the rows live on).
    """

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.pending: _InFlight | None = None

    def start(self, step: int, window: Window, user: dict[str, list], extra: dict, signal: int) -> None:
        """Start gathering ``window`` (read, not reset) and ``user`` metrics as the line of ``step``."""
        now = time.perf_counter()
        # (2 + len(FIELDS) + 3,): the loss sum stays on the device, so nothing waits for it here.
        row = [0.0, float(window.samples), *window.spent(now), window.median_step_s(), float(bool(user))]
        mine = torch.tensor([*row, float(signal)], dtype=torch.float64).to(self.env.device)
        mine[:1].copy_(window.loss_sum())  # on the device, in float64: no sync
        rows = [torch.empty_like(mine) for _ in range(self.env.world_size)]
        work = dist.all_gather(rows, mine, async_op=True)
        self.pending = _InFlight(step, rows, work, now - window.start, extra, user)

    def finish(self) -> tuple[dict, int]:
        """Wait for the gather in flight; its record, and the largest signal any rank sent."""
        gather, self.pending = self.pending, None
        gather.work.wait()
        # One transfer to Python lists: each tensor op on a few numbers costs more than the numbers.
        table = torch.stack(gather.rows).cpu().tolist()  # (world_size, 2 + len(FIELDS) + 3)
        # Whether any rank logged metrics rode on the tensor gather, so the pickled gather of their
        # names and values (ranks may have logged different ones) runs only when there are some.
        means = gather_means(self.env, gather.user) if max(row[-2] for row in table) > 0 else {}
        loss_sum, samples = sum(row[0] for row in table), int(sum(row[1] for row in table))
        record = {
            "step": gather.step,
            "loss": loss_sum / max(samples, 1),
            "samples_per_s": samples / gather.elapsed,
            "time_s": gather.elapsed,
            # The slowest rank's median step in the window: what default log lines are paced by.
            "step_s": max(row[2 + len(FIELDS)] for row in table),
            **gather.extra,
            **means,
            # Each rank's seconds in this window: `ddpkit report` sums them over the lines.
            "ranks": [
                {"rank": r, **{f: round(row[2 + i], 6) for i, f in enumerate(FIELDS)}}
                for r, row in enumerate(table)
            ],
        }
        return record, int(max(row[-1] for row in table))


def gather_means(env: DistEnv, logged: dict[str, list]) -> dict[str, float]:
    """Each metric's mean over every value any rank logged (``name -> [sum, count]`` per rank).

    Collective (all_gather_object): every rank calls it, also one that logged nothing.
    """
    mine = {name: (float(total), count) for name, (total, count) in logged.items()}
    everyone: list[dict | None] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    totals: dict[str, list[float]] = {}
    for theirs in everyone:
        for name, (total, count) in theirs.items():
            both = totals.setdefault(name, [0.0, 0])
            both[0] += total
            both[1] += count
    return {name: total / count for name, (total, count) in totals.items()}
