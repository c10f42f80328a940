"""Communication hooks: how one full bucket is averaged across ranks.

A hook is any callable ``hook(bucket, process_group, divisor) -> handle`` (``CommHook``, defined
beside the ``Bucket`` that calls it) where ``handle.wait()`` leaves the average over ranks in
``bucket.buffer`` (from where the parameters' ``.grad`` get it). Hooks written for torch's DDP,
``hook(state, GradBucket) -> Future``, go through ``DataParallel.register_comm_hook`` instead
(``ddpkit.parallel.torch_hooks``). The reducer calls the hook as soon as the bucket is full, while
backward still runs, and waits on the handles once at the end of backward. ``divisor`` is the
world size. A hook with ``scale_on_copy = True`` gets a bucket already multiplied by 1 / divisor:
the reducer folds the scaling into the copy that moves each gradient into the bucket, one pass
over memory instead of two.

Each hook mirrors the order of operations of torch's matching DDP comm hook, so results agree
with torch bit for bit where the arithmetic allows (world size 2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.choices import COMPRESSIONS, powersgd_settings
from ddpkit.errors import ConfigError
from ddpkit.parallel.bucket import Bucket, CommHook, Handle
from ddpkit.parallel.powersgd import PowerSGD


def allreduce_hook(bucket: Bucket, process_group: dist.ProcessGroup, divisor: int) -> Handle:
    """Average in full precision: scale by 1/world_size, then all-reduce (sum) in place.

    Scaling before the sum is what torch's reducer does when no hook is set (it multiplies by
    1/world_size while copying into the bucket), so the two agree bit for bit; it also keeps
    the sum from overflowing. Usable inside your own hooks.
    """
    bucket.buffer.mul_(1.0 / divisor)
    return dist.all_reduce(bucket.buffer, group=process_group, async_op=True)


class PrescaledAllReduce:
    """The default hook: ``allreduce_hook`` with the scaling done by the reducer during the copy-in."""

    scale_on_copy = True

    def __call__(self, bucket: Bucket, process_group: dist.ProcessGroup, divisor: int) -> Handle:
        return dist.all_reduce(bucket.buffer, group=process_group, async_op=True)


class _CastBack:
    """Waits for an all-reduce of a low-precision copy, then writes it back into the bucket."""

    def __init__(self, work: dist.Work, low: Tensor, buffer: Tensor) -> None:
        self.work, self.low, self.buffer = work, low, buffer

    def wait(self) -> None:
        self.work.wait()
        self.buffer.copy_(self.low)


class CastHook:
    """Send the bucket as ``dtype`` (bf16 or fp16): half the bytes, about 3 significant digits.

    Same steps as torch's ``bf16_compress_hook`` / ``fp16_compress_hook``: cast, divide by the
    world size in low precision (before the sum, so fp16 does not overflow), all-reduce, cast back.
    The low-precision copy of each bucket is kept between steps instead of being reallocated.

    Args:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._low: dict[int, Tensor] = {}

    def __call__(self, bucket: Bucket, process_group: dist.ProcessGroup, divisor: int) -> Handle:
        low = self._low.get(bucket.index)
        if low is None or low.numel() != bucket.buffer.numel():
            low = self._low[bucket.index] = torch.empty_like(bucket.buffer, dtype=self.dtype)
        low.copy_(bucket.buffer).div_(divisor)
        work = dist.all_reduce(low, group=process_group, async_op=True)
        return _CastBack(work, low, bucket.buffer)


def parse_powersgd(spec: str) -> PowerSGD:
    """``"powersgd"``, ``"powersgd:RANK"`` or ``"powersgd:RANK:START_ITER"`` as a PowerSGD hook.

    Args:
        spec: the string, read by ``ddpkit.choices.powersgd_settings`` (which the config's check
            shares): RANK is ``matrix_approximation_rank`` (default 1), START_ITER the plain
            all-reduce steps before compressing (default 10).
    """
    return PowerSGD(**powersgd_settings(spec))


def make_hook(compression: str | CommHook | None) -> CommHook:
    """Turn DataParallel's ``compression`` argument into a hook.

    Args:
        compression: None (full precision), ``"bf16"``, ``"fp16"``, ``"powersgd"``
            (``PowerSGD()`` with its defaults: rank 1, as torch's), ``"powersgd:RANK"`` or
            ``"powersgd:RANK:START_ITER"`` (``"powersgd:4"`` is
            ``PowerSGD(matrix_approximation_rank=4)``), or any hook callable.
    """
    if compression is None:
        return PrescaledAllReduce()
    if callable(compression):
        return compression
    if compression == "bf16":
        return CastHook(torch.bfloat16)
    if compression == "fp16":
        return CastHook(torch.float16)
    if isinstance(compression, str) and compression.startswith("powersgd"):
        return parse_powersgd(compression)
    raise ConfigError(
        f"unknown compression {compression!r}; use None, one of {', '.join(COMPRESSIONS)}, "
        "powersgd:RANK[:START_ITER], or a hook such as ddpkit.parallel.PowerSGD(matrix_approximation_rank=2)"
    )
