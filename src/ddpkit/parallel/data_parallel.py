"""``DataParallel``: the module wrapper users see. It keeps replicas in step around each forward;
the ``Reducer`` does the gradient work in backward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddpkit.diagnostics.threads import warn_if_oversubscribed
from ddpkit.errors import ConfigError
from ddpkit.parallel.bucket import FIRST_BUCKET_BYTES
from ddpkit.parallel.compression import CommHook, make_hook
from ddpkit.parallel.join import DataParallelJoinHook, agree_on_rank, agree_to_sync
from ddpkit.parallel.reducer import Reducer
from ddpkit.parallel.sync import broadcast_coalesced, find_tensors, verify_same_params


class DataParallel(nn.Module, Joinable):
    """Data parallelism with a gradient-synchronization engine written in Python.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` on the common path: wrap the
    model once per process, then train as usual; after ``loss.backward()`` every ``.grad``
    holds the average over ranks. Each ``.grad`` is a view into a flat bucket, and a bucket's
    all-reduce starts as soon as its last gradient is ready, while backward continues.

    Args:
        module: the model, already on this rank's device(s); the same model on every rank.
        process_group: ranks that average gradients; the default group when None.
        bucket_cap_mb: bucket size in MiB at which a bucket is closed.
        first_bucket_mb: size of the first bucket (and of a last one as small). None picks by
            device: 1 MiB on GPUs, where an early small all-reduce overlaps with backward; on the
            CPU, bucket_cap_mb (no small buckets), because gloo's copies and sums run on the cores
            backward is already using: overlap moves that work rather than hiding it, and each
            extra collective costs CPU time (``ddpkit bench engine --engines torch,native,native@1mib``:
            one bucket 0.991 and 0.978 of torch DDP's step in two runs, torch's layout 0.995 and 0.994).
        find_unused_parameters: after each forward, find the parameters the loss cannot reach
            and reduce zeros for them instead of waiting for gradients that never come.
        broadcast_buffers: copy rank 0's buffers (BatchNorm running statistics) to every rank
            before each forward.
        compression: None, ``"bf16"``, ``"fp16"``, ``"powersgd"`` or a hook callable
            (see ``ddpkit.parallel.compression``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float | None = None,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        compression: str | CommHook | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        _check_args(module, bucket_cap_mb, first_bucket_mb)
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.broadcast_buffers = broadcast_buffers
        verify_same_params(module, self.process_group)
        on_cpu = any(p.device.type == "cpu" for p in module.parameters())
        warn_if_oversubscribed(self.process_group, on_cpu=on_cpu)  # the usual cause of slow CPU DDP
        # Replicas must start identical; rank 0's initialization wins.
        broadcast_coalesced(list(module.parameters()) + list(module.buffers()), self.process_group, 0)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.reducer = Reducer(
            named,
            self.process_group,
            make_hook(compression),
            bucket_cap_bytes=int(bucket_cap_mb * 1024 * 1024),
            first_bucket_bytes=int(
                default_first_bucket_mb(module, bucket_cap_mb, first_bucket_mb) * 1024 * 1024
            ),
            find_unused_parameters=find_unused_parameters,
        )
        # nanoGPT-style code toggles this attribute directly; no_sync() is the polite way.
        self.require_backward_grad_sync = True
        self.sync_buffers_next = self.has_buffers_to_sync

    @property
    def has_buffers_to_sync(self) -> bool:
        """True when buffers are broadcast before forwards (broadcast_buffers and the model has some)."""
        return self.broadcast_buffers and any(True for _ in self.module.buffers())

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module; when gradients will be synchronized, arm the reducer."""
        self.reducer.raise_pending_error()
        joining = self._join_config.enable
        if joining:
            Join.notify_join_context(self).wait()
        if torch.is_grad_enabled():
            self.reducer.rebuild_buckets()
        if self.sync_buffers_next:
            src = agree_on_rank(self, True) if joining else 0
            broadcast_coalesced(self.module.buffers(), self.process_group, src)
        will_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if joining:
            agree_to_sync(self, will_sync)
        output = self.module(*inputs, **kwargs)
        if will_sync:
            self.reducer.prepare_for_backward(find_tensors(output) if self.reducer.find_unused else [])
        # torch DDP skips the buffer sync after a forward that did not sync (no_sync, no_grad).
        self.sync_buffers_next = will_sync and self.has_buffers_to_sync
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forwards and backwards inside skip all communication.

        The first synchronized backward after the context reduces the accumulated sum once.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def join(self, enable: bool = True, throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs: ranks that finish early shadow the others' collectives.

        Gradients are still divided by the full world size, so a step where some ranks have
        joined weighs their (zero) contributions too, as torch DDP does by default.

        Args:
            enable: False turns the context manager into a no-op.
            throw_on_early_termination: raise on every rank as soon as one runs out of data,
                instead of shadowing.
        """
        return Join([self], enable=enable, throw_on_early_termination=throw_on_early_termination)

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``Join`` runs on a rank that has no data left."""
        return DataParallelJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Device of the small tensors that join's own all-reduces use."""
        return next(self.module.parameters()).device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The process group join's all-reduces run in."""
        return self.process_group


def default_first_bucket_mb(module: nn.Module, bucket_cap_mb: float, first_bucket_mb: float | None) -> float:
    """``first_bucket_mb`` as given, or by device: bucket_cap_mb when every parameter is on the CPU."""
    if first_bucket_mb is not None:
        return first_bucket_mb
    if all(p.device.type == "cpu" for p in module.parameters()):
        return bucket_cap_mb
    return FIRST_BUCKET_BYTES / (1024 * 1024)


def _check_args(module: nn.Module, bucket_cap_mb: float, first_bucket_mb: float | None) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "DataParallel needs a process group; call ddpkit.init_distributed() before wrapping the model"
        )
    if not bucket_cap_mb > 0:
        raise ConfigError(f"bucket_cap_mb {bucket_cap_mb} must be positive, for example bucket_cap_mb=25")
    if first_bucket_mb is not None and not first_bucket_mb > 0:
        raise ConfigError(
            f"first_bucket_mb {first_bucket_mb} must be positive (or None to pick by device), for example 1"
        )
    sparse = [name for name, m in module.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ConfigError(
            f"DataParallel does not reduce sparse gradients, and {sparse[0]!r} makes them (sparse=True); "
            "build it with sparse=False, or train with --engine torch"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigError(
            f"DataParallel got a {type(module).__name__} with no parameter that requires grad; "
            "there is nothing to synchronize, so use the module without DataParallel"
        )
