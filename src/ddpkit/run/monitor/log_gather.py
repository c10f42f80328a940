"""A log step's collective: every rank's loss, timings and run.log values, gathered into one record.

At a log step each rank puts its window (loss sum, samples, the data / compute / comm-wait split,
its median step, whether it logged metrics, a preemption signal) in one float64 row and starts an
``all_gather`` of the rows without waiting for it; the loop goes on, and the gather is finished at
the next step's end or the run's last step. So a log step costs no wait for the slowest rank and
no device sync. The pickled gather of run.log names and values runs only when some rank logged.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.diagnostics.stats import FIELDS, Window
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError

HEAD = 6  # a row's fields before the timings: loss sum, its denominator, samples, tokens, peak memory x2


def peak_memory_mb(device: torch.device) -> tuple[float, float]:
    """This process's peak resident memory and (on a GPU) peak allocated device memory, in MiB:
    counters the OS and the caching allocator keep, read without a device sync."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    cuda = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    return rss, cuda


# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, matched in this order
# against torch.cuda.get_device_name(); fp16 where the GPU has no bf16 (V100, T4).
GPU_PEAKS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def device_peak(device: torch.device, given: float | None) -> float | None:
    """One device's peak FLOP/s: ``given``, else a listed GPU's; None when neither is known."""
    if given is not None or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAKS if key in name), None)


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
        flops_per_sample: FLOPs of one sample's forward and backward; None: no mfu.
        peak: one device's peak FLOP/s (``device_peak``); None: no mfu.
    """

    def __init__(
        self, env: DistEnv, flops_per_sample: float | None = None, peak: float | None = None
    ) -> None:
        self.env = env
        self.pending: _InFlight | None = None
        # FLOP/s of every device together, for mfu; None: not known, no mfu.
        self.world_peak = peak * env.world_size if flops_per_sample and peak else None
        self.flops_per_sample = flops_per_sample

    def start(self, step: int, window: Window, user: dict[str, list], extra: dict, signal: int) -> None:
        """Start gathering ``window`` (read, not reset) and ``user`` metrics as the line of ``step``."""
        now = time.perf_counter()
        # (HEAD + len(FIELDS) + 3,): the loss sum and its denominator stay on the device, so nothing
        # waits for them here.
        row = [0.0, 0.0, float(window.samples), float(window.tokens), *peak_memory_mb(self.env.device)]
        row += [*window.spent(now), window.median_step_s()]
        mine = torch.tensor([*row, float(bool(user)), float(signal)], dtype=torch.float64).to(self.env.device)
        mine[:2].copy_(window.loss_sum())  # on the device, in float64: no sync
        rows = [torch.empty_like(mine) for _ in range(self.env.world_size)]
        work = dist.all_gather(rows, mine, async_op=True)
        self.pending = _InFlight(step, rows, work, now - window.start, extra, user)

    def finish(self) -> tuple[dict, int]:
        """Wait for the gather in flight; its record, and the largest signal any rank sent."""
        gather, self.pending = self.pending, None
        gather.work.wait()
        # One transfer to Python lists: each tensor op on a few numbers costs more than the numbers.
        table = torch.stack(gather.rows).cpu().tolist()  # (world_size, HEAD + len(FIELDS) + 3)
        # Whether any rank logged metrics rode on the tensor gather, so the pickled gather of their
        # names and values (ranks may have logged different ones) runs only when there are some.
        means = gather_means(self.env, gather.user) if max(row[-2] for row in table) > 0 else {}
        loss_sum, denom = sum(row[0] for row in table), sum(row[1] for row in table)
        samples, tokens = int(sum(row[2] for row in table)), int(sum(row[3] for row in table))
        record = {
            "step": gather.step,
            "loss": loss_sum / denom if denom else 0.0,
            "samples_per_s": samples / gather.elapsed,
            **({"tokens_per_s": tokens / gather.elapsed} if tokens else {}),
            **(
                {"mfu": samples * self.flops_per_sample / gather.elapsed / self.world_peak}
                if self.world_peak
                else {}
            ),
            "peak_rss_mb": round(max(row[4] for row in table), 1),  # the largest rank's
            **(
                {"peak_cuda_mb": round(max(row[5] for row in table), 1)}
                if self.env.device.type == "cuda"
                else {}
            ),
            "time_s": gather.elapsed,
            # The slowest rank's median step in the window: what default log lines are paced by.
            "step_s": max(row[HEAD + len(FIELDS)] for row in table),
            **gather.extra,
            **means,
            # Each rank's seconds in this window: `ddpkit report` sums them over the lines.
            "ranks": [
                {"rank": r, **{f: round(row[HEAD + i], 6) for i, f in enumerate(FIELDS)}}
                for r, row in enumerate(table)
            ],
        }
        return record, int(max(row[-1] for row in table))


def gather_means(env: DistEnv, logged: dict[str, list]) -> dict[str, float]:
    """Each metric's value over every rank (``name -> [total, weight, reduce, steps]`` per rank):
    ``mean``, the weighted mean (total / weight); ``sum``, the total per step it was logged in (over
    the union of every rank's steps). A mean whose every value had weight 0 (only a rank without
    samples logged it) is left out.

    Collective (all_gather_object): every rank calls it, also one that logged nothing.
    """
    mine = {
        name: (float(total), float(weight), how, sorted(steps))
        for name, (total, weight, how, steps) in logged.items()
    }
    everyone: list[dict | None] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    totals: dict[str, list] = {}
    for theirs in everyone:
        for name, (total, weight, how, steps) in theirs.items():
            both = totals.setdefault(name, [0.0, 0.0, how, set()])
            if both[2] != how:
                raise ConfigError(
                    f"run.log({name}=...) was logged with reduce={both[2]!r} and {how!r}; use one"
                )
            both[0] += total
            both[1] += weight
            both[3].update(steps)
    return {
        name: total / weight if how == "mean" else total / max(len(steps), 1)
        for name, (total, weight, how, steps) in totals.items()
        if how == "sum" or weight > 0
    }
