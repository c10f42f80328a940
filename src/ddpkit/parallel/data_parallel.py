"""``DataParallel``: the module wrapper users see. It keeps replicas in step around each forward;
the ``Reducer`` does the gradient work in backward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddpkit.dist.threads import warn_if_oversubscribed
from ddpkit.parallel import checks
from ddpkit.parallel.bucket import CommHook
from ddpkit.parallel.compression import make_hook
from ddpkit.parallel.errors import DataParallelError
from ddpkit.parallel.join import DataParallelJoinHook, agree_on_rank, agree_to_sync
from ddpkit.parallel.reducer import Reducer
from ddpkit.parallel.sync import (
    broadcast_coalesced,
    call_module,
    eager,
    find_tensors,
    managed_buffers,
    managed_params,
    map_tensors,
    verify_same_params,
)
from ddpkit.parallel.torch_hooks import TorchCommHook, check_comm_hook


class DataParallel(nn.Module, Joinable):
    """Data parallelism with a gradient-synchronization engine written in Python.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel``: the same arguments in the same
    order, ``no_sync``, ``join``, ``register_comm_hook`` with torch's hooks, pickling. Wrap the
    model once per process, then train as usual; after ``loss.backward()`` every ``.grad``
    holds the average over ranks. A bucket's all-reduce starts as soon as its last gradient is
    ready, while backward continues.

    Args:
        module: the model, already on this rank's device(s); the same model on every rank.
        device_ids: None, or ``[device]`` for a module on one GPU (inputs are moved there).
        output_device: None, or that same device.
        dim: kept for torch's signature; inputs are never split here.
        broadcast_buffers: copy rank 0's buffers (BatchNorm running statistics) to every rank
            at construction and before each forward. False skips both, as in torch.
        init_sync: check that every rank has the same parameters, then copy rank 0's.
        process_group: ranks that average gradients; the default group when None.
        bucket_cap_mb: bucket size in MiB at which a bucket is closed (25 when None).
        find_unused_parameters: after each forward, find the parameters the loss cannot reach and
            count them as ready; gradients from ``no_sync`` micro-batches are still averaged.
        check_reduction: deprecated in torch; does nothing.
        gradient_as_bucket_view: each ``.grad`` is a view into its bucket, which saves one copy
            of the gradients in memory and time. Default True, unlike torch's False: the values
            are the same either way; the views cannot be ``detach_()``-ed in place.
        static_graph: the same parameters are used, the same number of times, in every step
            (activation checkpointing may use one twice): learnt in the first step, so later
            steps need neither ``find_unused_parameters``' graph walk nor its all-reduce.
        forward_sync_buffers: torch 2.13's name for broadcasting buffers before each forward;
            False still copies them once at construction. Overrides broadcast_buffers.
        first_bucket_mb: size of the first bucket (and of a last one as small). None picks by
            device: 1 MiB on GPUs (torch's layout); on the CPU the first synchronized passes try
            one bucket against buckets of a few MiB and keep the faster, logged once
            (``ddpkit.parallel.layout``): one bucket where communication is cheap, since gloo's
            copies and sums run on the cores backward uses; a few MiB each on a slow link, where
            their all-reduces overlap with backward.
        compression: None, ``"bf16"``, ``"fp16"``, ``"powersgd"`` or a hook callable
            (see ``ddpkit.parallel.compression``); torch's hooks go to ``register_comm_hook``.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        *,
        forward_sync_buffers: bool | None = None,
        first_bucket_mb: float | None = None,
        compression: str | CommHook | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        bucket_cap_mb = checks.DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        params = managed_params(module)
        checks.check_args(module, params, bucket_cap_mb, first_bucket_mb)
        checks.warn_deprecated(check_reduction, static_graph, find_unused_parameters)
        self.module, self.dim = module, dim
        self.device = checks.check_devices(params, device_ids, output_device)
        self.device_ids = None if self.device is None else [self.device.index]
        self.output_device = None if self.device is None else self.device.index
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        broadcast = True if broadcast_buffers is None else broadcast_buffers
        self.forward_sync_buffers = broadcast if forward_sync_buffers is None else forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view, self.static_graph = gradient_as_bucket_view, static_graph
        self.bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024)
        self.first_bucket_bytes = int(
            checks.default_first_bucket_mb(module, bucket_cap_mb, first_bucket_mb) * 2**20
        )
        self.auto_layout = first_bucket_mb is None and all(p.device.type == "cpu" for p in params)
        warn_if_oversubscribed(on_cpu=any(p.device.type == "cpu" for p in params))
        if init_sync:  # torch: broadcast_buffers=False also skips the buffers here, forward_sync_buffers not
            self._sync_initial_state(params, forward_sync_buffers is not None or broadcast)
        self._hook = make_hook(compression)
        self._hook_is_set = compression is not None
        self.reducer = self._make_reducer()
        # nanoGPT-style code toggles this attribute directly; no_sync() is the polite way.
        self.require_backward_grad_sync = True
        self.sync_buffers_next = self.has_buffers_to_sync

    def _sync_initial_state(self, params: list[nn.Parameter], with_buffers: bool) -> None:
        verify_same_params(self.module, self.process_group)
        # Replicas must start identical; rank 0's initialization wins.
        buffers = managed_buffers(self.module) if with_buffers else []
        broadcast_coalesced(params + buffers, self.process_group, 0)

    def _make_reducer(self) -> Reducer:
        named = [(name, p) for name, p in managed_params(self.module, named=True) if p.requires_grad]
        return Reducer(
            named,
            self.process_group,
            self._hook,
            bucket_cap_bytes=self.bucket_bytes_cap,
            first_bucket_bytes=self.first_bucket_bytes,
            find_unused_parameters=self.find_unused_parameters and not self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            auto_layout=getattr(self, "auto_layout", False),  # pickles from before it existed
        )

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast before each forward (torch's old name)."""
        return self.forward_sync_buffers

    @property
    def has_buffers_to_sync(self) -> bool:
        """True when buffers are broadcast before forwards (forward_sync_buffers and the model has some)."""
        return self.forward_sync_buffers and bool(managed_buffers(self.module))

    # torch.compile compiles the module this calls as one graph; the reducer's bookkeeping around
    # it runs eagerly (``eager``), never traced (traced, it cost 3 more graphs and 5 breaks).
    def forward(self, *inputs, **kwargs):
        """Run the wrapped module; when gradients will be synchronized, arm the reducer."""
        will_sync, inputs, kwargs = self._pre_forward(inputs, kwargs)
        return self._post_forward(call_module(self.module, *inputs, **kwargs), will_sync)

    @eager
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[bool, tuple, dict]:
        self.reducer.raise_pending_error()
        joining = self._join_config.enable
        if joining:
            Join.notify_join_context(self).wait()
        if torch.is_grad_enabled():
            self.reducer.rebuild_buckets()
        if self.sync_buffers_next:
            src = agree_on_rank(self, True) if joining else 0
            broadcast_coalesced(managed_buffers(self.module), self.process_group, src)
        will_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if joining:
            agree_to_sync(self, will_sync)
        if self.device is not None:
            inputs, kwargs = map_tensors((inputs, kwargs), lambda t: t.to(self.device, non_blocking=True))
        return will_sync, inputs, kwargs

    @eager
    def _post_forward(self, output: object, will_sync: bool) -> object:
        if will_sync:
            self.reducer.prepare_for_backward(find_tensors(output) if self.reducer.find_unused else [])
            if self.reducer.recording:
                output = self._sink(output)
        # torch DDP skips the buffer sync after a forward that did not sync (no_sync, no_grad).
        self.sync_buffers_next = will_sync and self.has_buffers_to_sync
        return output

    def _sink(self, output: object) -> object:
        # static_graph's first pass ends where the whole backward ends, which only a node on
        # the outputs sees (a hook may fire inside a checkpoint's inner backward).
        tensors = [t for t in find_tensors(output) if t.grad_fn is not None]
        if not tensors:
            return output
        sunk = dict(zip(map(id, tensors), self.reducer.sink(tuple(tensors)), strict=True))
        return map_tensors(output, lambda t: sunk.get(id(t), t))

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

    def register_comm_hook(self, state: object, hook) -> None:
        """Reduce buckets with a hook written for torch's DDP: ``hook(state, bucket) -> Future[Tensor]``.

        torch's own hooks work unchanged (``default_hooks.allreduce_hook``, ``fp16_compress_hook``,
        ``bf16_compress_hook`` (also on CPU over gloo, which torch's DDP refuses),
        ``powerSGD_hook.powerSGD_hook`` with a ``PowerSGDState``). As in torch, the bucket is not
        divided by the world size first, and a hook can be registered once, before training.

        Args:
            state: passed to every call of ``hook``; torch's default hooks take a process group
                (None: the default group).
            hook: the communication hook.
        """
        check_comm_hook(hook)
        if self._hook_is_set:
            raise RuntimeError(
                "register_comm_hook can only be called once, and not with DataParallel(compression=...)"
            )
        self._hook, self._hook_is_set = TorchCommHook(state, hook), True
        self.reducer.set_hook(self._hook)

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for uneven inputs: ranks that finish early shadow the others' collectives.

        Args:
            divide_by_initial_world_size: divide by the full world size even in steps where some
                ranks have joined (their contributions are zeros), as torch DDP does by default.
                False is not supported.
            enable: False turns the context manager into a no-op.
            throw_on_early_termination: raise on every rank as soon as one runs out of data,
                instead of shadowing.
        """
        if not divide_by_initial_world_size:
            raise NotImplementedError(
                "DataParallel.join(divide_by_initial_world_size=False) is not supported; use the default"
            )
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

    def replan(self) -> None:
        """Rebuild the buckets for the parameters that require grad now (after freezing or
        unfreezing some). Every rank calls it at the same point, between two steps."""
        self.reducer.remove_hooks()
        self.reducer = self._make_reducer()

    def __getstate__(self) -> dict:
        """Pickle (``torch.save(model)``, ``copy.deepcopy``) without the process group and reducer.

        As in torch's DDP, only a DataParallel on the default process group can be pickled; the
        copy joins the default group of the process that loads it. A hook's state is pickled with it.
        """
        if self.process_group not in (dist.group.WORLD, dist.distributed_c10d._get_default_group()):
            raise DataParallelError(
                "DataParallel can be pickled only on the default process group (no process_group "
                "argument); save model.module or its state_dict instead"
            )
        state = dict(self.__dict__)
        del state["process_group"], state["reducer"]
        return state

    def __setstate__(self, state: dict) -> None:
        """Rebuild the reducer on the default process group after unpickling."""
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        self.reducer = self._make_reducer()
