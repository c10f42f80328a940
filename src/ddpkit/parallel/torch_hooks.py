"""Communication hooks written for torch's DDP, ``hook(state, GradBucket) -> Future[Tensor]``, run
on our buckets: torch's ``default_hooks`` (allreduce, fp16, bf16), PowerSGD, or your own.

torch's contract, which ``TorchCommHook`` keeps: the bucket is not pre-divided by the world size
(the hook divides); the Future's value is the reduced bucket, copied back into the buffer if the
hook returned another tensor; ``GradBucket`` offers ``index``, ``is_last``, ``buffer``,
``set_buffer``, ``gradients`` and ``parameters``.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.parallel.bucket import Bucket
from ddpkit.parallel.flat import unflatten


class GradBucket:
    """What a torch comm hook sees of one bucket (torch's ``dist.GradBucket`` interface).

    Args:
        bucket: the bucket being reduced.
    """

    def __init__(self, bucket: Bucket) -> None:
        self._bucket = bucket
        self._buffer = bucket.buffer

    def index(self) -> int:
        """Position of the bucket in the reduction order; 0 is reduced first."""
        return self._bucket.index

    def is_last(self) -> bool:
        """True for the last bucket of a backward pass (PowerSGD counts steps on it)."""
        return self._bucket.is_last

    def buffer(self) -> Tensor:
        """The flat gradients, not yet divided by the world size."""
        return self._buffer

    def set_buffer(self, buffer: Tensor) -> None:
        """Replace the tensor ``buffer()`` and ``gradients()`` return (torch's compress wrappers do)."""
        self._buffer = buffer

    def gradients(self) -> list[Tensor]:
        """One view into ``buffer()`` per parameter, shaped like it."""
        return unflatten(self._buffer, self._bucket.params)

    def parameters(self) -> list[nn.Parameter]:
        """The bucket's parameters, in buffer order."""
        return list(self._bucket.params)


class _FutureHandle:
    """Waits for a hook's Future and leaves its value in the bucket's buffer."""

    def __init__(self, future: torch._C.Future, buffer: Tensor) -> None:
        self.future, self.buffer = future, buffer

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        result = self.future.wait()
        if isinstance(result, (list, tuple)):  # an all-reduce's own future holds [tensor]
            assert len(result) == 1, f"a comm hook's Future holds one tensor, got {len(result)}"
            result = result[0]
        if not isinstance(result, Tensor) or result.numel() != self.buffer.numel():
            raise RuntimeError(
                f"a DDP comm hook's Future must hold one tensor of {self.buffer.numel()} elements "
                f"(the reduced bucket), got {type(result).__name__}"
                f"{'' if not isinstance(result, Tensor) else f' of {result.numel()}'}"
            )
        if result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result.view_as(self.buffer))


class TorchCommHook:
    """Adapts ``hook(state, GradBucket) -> Future`` to the engine's hook protocol.

    torch's hooks may start collectives from Future callbacks (PowerSGD does), and those run on
    gloo's threads, so with two buckets in flight the ranks could issue them in different orders
    and pair up the wrong ones. ``serial`` tells the reducer to start a bucket only after the
    previous bucket's Future is done.

    Args:
        state: passed to ``hook`` as its first argument (torch: a process group, PowerSGDState, ...).
        hook: the communication hook.
    """

    scale_on_copy = False  # torch's hooks divide by the world size themselves
    serial = True

    def __init__(self, state: object, hook) -> None:
        self.state, self.hook = state, hook

    def __call__(self, bucket: Bucket, process_group: dist.ProcessGroup, divisor: int) -> _FutureHandle:
        future = self.hook(self.state, GradBucket(bucket))
        if not isinstance(future, torch._C.Future):  # Work.get_future() makes the C++ type
            raise RuntimeError(
                f"comm hook {_name(self.hook)} returned {type(future).__name__}; it must return a "
                "torch.futures.Future holding the reduced bucket"
            )
        return _FutureHandle(future, bucket.buffer)


def check_comm_hook(hook) -> None:
    """Raise torch's errors for a hook torch's DDP would refuse: TypeError, or ValueError for
    annotations other than ``dist.GradBucket`` and ``Future[Tensor]``."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable, got {type(hook).__name__}")
    try:  # resolve string annotations (``from __future__ import annotations``)
        signature = inspect.signature(hook, eval_str=True)
    except Exception:  # names the hook's module cannot resolve: leave the strings, unchecked
        signature = inspect.signature(hook)
    bucket = signature.parameters.get("bucket")
    if bucket is not None and not _fits(bucket.annotation, dist.GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if not _fits(signature.return_annotation, torch.futures.Future[torch.Tensor]):
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
        )


def _fits(annotation: object, expected: object) -> bool:
    # No annotation, the expected one, or a string that could not be resolved.
    return annotation is inspect.Parameter.empty or annotation == expected or isinstance(annotation, str)


def _name(hook) -> str:
    return getattr(hook, "__qualname__", type(hook).__name__)
