"""Gradient buckets: one flat buffer per group of parameters, and the rule that forms the groups.

A bucket owns a flat 1-D buffer, the collective that reduces it, and the copies in and out of
its parameters' ``.grad``. By default each ``.grad`` is a view into that buffer, so the engine
keeps no second copy of the gradients and the all-reduce runs on the gradients themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.parallel.flat import unflatten

# Gradients arrive roughly in reverse registration order, so the first bucket holds the last
# layers; keeping it small lets its all-reduce start early in backward. 1 MiB is torch DDP's value.
# DataParallel uses it where that overlap pays: on GPUs, not on a CPU whose cores run backward.
FIRST_BUCKET_BYTES = 1024 * 1024


class Handle(Protocol):
    """What a hook returns: ``wait()`` blocks until the bucket holds the averaged gradient."""

    def wait(self) -> object: ...


# What ``Bucket.launch`` calls: ``hook(bucket, process_group, divisor) -> handle``. The hooks
# ddpkit ships are in ``ddpkit.parallel.compression``.
CommHook = Callable[["Bucket", dist.ProcessGroup, int], Handle]


def assign_buckets(
    params: Sequence[nn.Parameter],
    order: Sequence[int],
    first_cap_bytes: int,
    cap_bytes: int,
    last_cap_bytes: int = 0,
) -> list[list[int]]:
    """Group parameter indices into buckets, in ``order``, one group per (dtype, device).

    A bucket is closed as soon as it reaches its cap (so it may pass the cap by its last
    parameter, as in torch DDP); the first bucket of each (dtype, device) gets ``first_cap_bytes``,
    the later ones ``cap_bytes``. With ``last_cap_bytes``, the last parameters in ``order`` are
    set apart first, in a bucket just reaching that size: it is the one bucket whose all-reduce
    cannot overlap with backward, so keeping it small shortens the wait at the end.

    Args:
        params: all parameters that take part, by index.
        order: the indices in the order their gradients are expected to arrive.
        first_cap_bytes: size at which the first bucket of a (dtype, device) is closed.
        cap_bytes: size at which every later bucket is closed.
        last_cap_bytes: size of the small last bucket of each (dtype, device); 0 for none.
    """
    tails = _tails(params, order, last_cap_bytes)
    in_tail = {index for tail in tails.values() for index in tail}
    closed: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    caps: dict[tuple[torch.dtype, torch.device], int] = {}
    for index in (i for i in order if i not in in_tail):
        key = _key(params[index])
        open_.setdefault(key, []).append(index)
        sizes[key] = sizes.get(key, 0) + _nbytes(params[index])
        if sizes[key] >= caps.setdefault(key, first_cap_bytes):
            closed.append(open_.pop(key))
            sizes[key], caps[key] = 0, cap_bytes
    return closed + [indices for indices in open_.values() if indices] + list(tails.values())


def _tails(params: Sequence[nn.Parameter], order: Sequence[int], cap: int) -> dict[tuple, list[int]]:
    tails: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    if cap <= 0:
        return tails
    for index in reversed(order):
        key = _key(params[index])
        if sizes.get(key, 0) < cap:
            tails.setdefault(key, []).insert(0, index)
            sizes[key] = sizes.get(key, 0) + _nbytes(params[index])
    return tails


def _key(param: nn.Parameter) -> tuple[torch.dtype, torch.device]:
    return param.dtype, param.device


def _nbytes(param: nn.Parameter) -> int:
    return param.numel() * param.element_size()


class Bucket:
    """A flat gradient buffer shared by a few parameters of one dtype and device, and its collective.

    Life of a bucket in one synchronized backward pass: ``reset`` (every parameter pending) ->
    ``add_grad`` or ``add_unused`` once per parameter -> ``launch`` the communication hook when
    none is pending -> ``wait`` -> ``write_back`` puts the average into each parameter's ``.grad``.

    With ``grad_as_view`` each ``.grad`` is a view into the buffer (torch's
    ``gradient_as_bucket_view=True``): no second copy of the gradients exists, and ``write_back``
    has nothing to copy. Without it ``.grad`` stays the tensor autograd made, and the average
    is copied in and out, as torch's DDP does by default.

    Args:
        index: position in the reduction order; hooks key their per-bucket state on it.
        params: the parameters, in buffer order.
        indices: each parameter's index in the reducer's parameter list.
        grad_as_view: make each ``.grad`` a view into the buffer.
        is_last: the last bucket to be reduced (torch's ``GradBucket.is_last``).
    """

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        indices: Sequence[int],
        grad_as_view: bool = True,
        is_last: bool = False,
    ) -> None:
        assert params and len(params) == len(indices), "a bucket holds at least one parameter, each indexed"
        self.index, self.is_last, self.grad_as_view = index, is_last, grad_as_view
        self.params, self.indices = list(params), list(indices)
        first = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        self.views = unflatten(self.buffer, self.params)
        self.pending = len(self.params)
        self.work: Handle | None = None
        # create_graph=True: the local gradients that carry a graph, by position; see write_back.
        self.graphs: dict[int, Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        """Mark every parameter pending again, at the start of a synchronized backward."""
        assert self.work is None, f"bucket {self.index} was reset with its collective still in flight"
        self.pending = len(self.params)
        self.graphs.clear()

    def add_grad(self, pos: int, scale: float | None) -> bool:
        """Move parameter ``pos``'s new gradient into the buffer; True when the bucket became full.

        When ``.grad`` is already our view (the steady state with ``grad_as_view`` and
        ``zero_grad(set_to_none=False)``) nothing is copied; otherwise it is copied in once and,
        with ``grad_as_view``, ``.grad`` is pointed at the view. ``scale`` multiplies on the way
        in, which saves the hook a second pass over the bucket.
        """
        param, view = self.params[pos], self.views[pos]
        if param.grad is view:
            if scale is not None:
                view.mul_(scale)
        else:
            self._copy_in(pos, param.grad, scale)
            if self.grad_as_view and pos not in self.graphs:
                param.grad = view
        return self._count_ready()

    def add_unused(self, pos: int, scale: float | None) -> bool:
        """Count parameter ``pos`` as ready though it got no gradient this pass (find_unused_parameters).

        As in torch's DDP, a gradient left from earlier passes (``no_sync``) is still contributed,
        and an absent one counts as zeros. A ``.grad`` that is our view is first detached into its
        own tensor, so that if no rank used the parameter its gradient stays exactly as it was.
        """
        param, view = self.params[pos], self.views[pos]
        if param.grad is view:
            param.grad = view.clone()
        self._copy_in(pos, param.grad, scale)
        return self._count_ready()

    def _count_ready(self) -> bool:
        assert self.pending > 0, f"bucket {self.index}: more parameters ready than it holds"
        self.pending -= 1
        return self.pending == 0

    def _copy_in(self, pos: int, grad: Tensor | None, scale: float | None) -> None:
        view = self.views[pos]
        if grad is None:
            view.zero_()
            return
        if grad.requires_grad:  # backward(create_graph=True): keep the graph for write_back,
            self.graphs[pos] = grad
            grad = grad.detach()  # and copy plain data (an out= op fails on a graph)
        if scale is None:
            view.copy_(grad)
        else:
            # torch's reducer does the same mul_out, so the rounding is identical.
            torch.mul(grad, scale, out=view)

    def launch(self, hook: CommHook, process_group: dist.ProcessGroup, world_size: int) -> None:
        """Start this bucket's collective with ``hook``; every parameter must be ready."""
        assert self.pending == 0, f"bucket {self.index} launched with {self.pending} parameter(s) pending"
        assert self.work is None, f"bucket {self.index} launched twice in one pass"
        self.work = hook(self, process_group, world_size)

    @property
    def launched(self) -> bool:
        """True between ``launch`` and ``wait``."""
        return self.work is not None

    def done(self) -> bool:
        """True when the collective has finished (without waiting for it)."""
        assert self.work is not None, f"bucket {self.index} was never launched"
        return bool(self.work.done()) if hasattr(self.work, "done") else bool(self.work.is_completed())

    def wait(self) -> None:
        """Block until the buffer holds the reduced gradients."""
        assert self.work is not None, f"bucket {self.index} waited on before it was launched"
        work, self.work = self.work, None
        work.wait()

    def abandon(self) -> None:
        """Forget the collective without waiting for it (a failed pass: waiting could hang)."""
        self.work = None

    def zero_for_join(self) -> None:
        """Fill the buffer with zeros and count every parameter ready: a joined rank's share."""
        self.buffer.zero_()
        self.pending = 0

    def write_back(self, pos: int, scale: float | None) -> None:
        """Give parameter ``pos`` the reduced gradient (after ``wait``).

        With create_graph=True the result keeps the local gradient's graph, scaled as on the
        way in: torch's DDP copies the scaled local gradient into the bucket with autograd on, so
        its second-order gradients are the local ones / world size (they are not all-reduced).
        """
        param, view = self.params[pos], self.views[pos]
        local = self.graphs.get(pos)
        if local is not None:
            with torch.enable_grad():
                param.grad = _KeepGraph.apply(local, view, scale)
        elif self.grad_as_view:
            if param.grad is not view:  # the setter checks shape and device: skip it when we can
                param.grad = view
        elif param.grad is None:
            param.grad = torch.empty_like(param).copy_(view)  # the parameter's memory layout
        else:
            with torch.no_grad():
                param.grad.copy_(view)

    def rebind_from(self, old: Bucket, pos_in_old: int, pos: int) -> None:
        """Carry a gradient that lives in ``old`` over to this bucket, when buckets are rebuilt."""
        param = self.params[pos]
        if param.grad is old.views[pos_in_old]:
            self.views[pos].copy_(param.grad)
            param.grad = self.views[pos]


class _KeepGraph(torch.autograd.Function):
    """The reduced gradient's values, differentiable as the local gradient times ``scale``."""

    @staticmethod
    def forward(ctx, local: Tensor, reduced: Tensor, scale: float | None) -> Tensor:
        ctx.scale = scale
        return reduced.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return (grad if ctx.scale is None else grad * ctx.scale), None, None
