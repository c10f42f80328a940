"""One synchronized backward pass: its state, the used-map all-reduce, and the output sink that
tells static_graph's first pass where the whole backward ends."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable


@dataclass
class Pass:
    """The state of one synchronized backward pass, from ``prepare_for_backward`` to its end.

    Args:
        expected: hook firings per parameter before its gradient is final (None: record them,
            static_graph's first pass).
        unused: parameters that will get no gradient in this pass.
    """

    expected: list[int] | None
    unused: list[int]
    fired: list[int] = field(default_factory=list)  # hook firings so far, per parameter
    waiting: int = 0  # parameters not yet in their bucket
    started: bool = False  # the first hook ran: used map started, unused parameters counted
    queued: bool = False  # the end-of-pass callback is queued on the autograd engine
    next_bucket: int = 0  # buckets are launched strictly in this order
    used_map: tuple[dist.Work, Tensor] | None = None
    armed_at: float = 0.0  # perf_counter() at the end of the forward (the layout trial times from it)
    ready_at: float = 0.0  # perf_counter() when the last gradient was in its bucket

    def queue_end(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the current backward graph is done, once per pass.

        Queued when the last gradient is in (or by the sink): a hook that fires inside a
        reentrant backward (activation checkpointing) would otherwise end the pass with the
        inner graph.
        """
        if not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(callback)


def all_reduce_used(
    used: list[bool], device: torch.device, group: dist.ProcessGroup
) -> tuple[dist.Work, Tensor]:
    """Start summing the used map over the ranks: entry i > 0 when any rank used parameter i."""
    flags = torch.tensor(used, dtype=torch.int32, device=device)
    return dist.all_reduce(flags, group=group, async_op=True), flags


class Sink(torch.autograd.Function):
    """Passes the forward's outputs through; its backward runs first in the outermost backward
    graph and queues ``end`` there (torch's DDP does the same for static_graph's first pass)."""

    @staticmethod
    def forward(ctx, end: Callable[[], None], *outputs: Tensor) -> tuple[Tensor, ...]:
        ctx.end = end
        return tuple(output.clone() for output in outputs)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        ctx.end()
        return (None, *grads)


def grad_hooks(reducer, params: list[Tensor]) -> list:
    """One post-accumulate-grad hook per parameter, calling ``reducer.on_grad_ready(index)``. The
    hooks live on the user's parameters, so they hold the reducer weakly: a dropped DataParallel
    is not kept alive by them."""
    me = weakref.ref(reducer)
    return [p.register_post_accumulate_grad_hook(_grad_hook(me, i)) for i, p in enumerate(params)]


def _grad_hook(reducer: weakref.ref, index: int):
    def hook(param: Tensor) -> None:
        live = reducer()
        if live is not None:
            live.on_grad_ready(index)

    return hook
