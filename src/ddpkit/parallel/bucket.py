"""Gradient buckets: one flat buffer per group of parameters, and the rule that forms the groups.

A bucket owns a flat 1-D buffer; each of its parameters' ``.grad`` is a view into that buffer,
so the engine keeps no second copy of the gradients and the all-reduce runs on the gradients
themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

# Gradients arrive roughly in reverse registration order, so the first bucket holds the last
# layers; keeping it small lets its all-reduce start early in backward. 1 MiB is torch DDP's value.
# DataParallel uses it where that overlap pays: on GPUs, not on a CPU whose cores run backward.
FIRST_BUCKET_BYTES = 1024 * 1024


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
    """A flat gradient buffer shared by a few parameters of one dtype and device.

    Life of a bucket in one synchronized backward pass: ``reset`` (all parameters pending) ->
    ``take_grad`` for each parameter as autograd finishes its gradient -> ``is_full`` -> the
    communication hook reduces ``buffer`` in place -> the parameters' ``.grad`` views hold the
    averaged gradient.

    Args:
        index: position in the reduction order; hooks key their per-bucket state on it.
        params: the parameters, in buffer order.
        indices: each parameter's index in the reducer's parameter list.
    """

    def __init__(self, index: int, params: Sequence[nn.Parameter], indices: Sequence[int]) -> None:
        self.index = index
        self.params = list(params)
        self.indices = list(indices)
        first = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        self.views: list[Tensor] = []
        offset = 0
        for param in self.params:
            self.views.append(self.buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        self.pending = len(self.params)

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        """Mark every parameter pending again, at the start of a synchronized backward."""
        self.pending = len(self.params)

    def take_grad(self, pos: int, scale: float | None = None) -> bool:
        """Move parameter ``pos``'s gradient into the buffer; True when the bucket became full.

        When ``.grad`` is already our view (the steady state with ``zero_grad(set_to_none=False)``)
        nothing is copied; after ``set_to_none`` autograd made a fresh tensor, so it is copied in
        once and ``.grad`` is pointed back at the view. ``scale`` multiplies on the way in, which
        saves the hook a second pass over the bucket.
        """
        self._move_in(pos, self.params[pos].grad, scale)
        self.pending -= 1
        return self.pending == 0

    def skip_param(self, pos: int, scale: float | None = None) -> bool:
        """Count parameter ``pos`` as ready though it got no gradient this pass (find_unused_parameters).

        Like torch DDP, a gradient left from earlier passes (``no_sync``) is still contributed, and
        an absent one counts as zeros. A ``.grad`` that is our view is first detached into its own
        tensor, so that if no rank used the parameter its gradient stays exactly as it was.
        """
        param, view = self.params[pos], self.views[pos]
        if param.grad is view:
            param.grad = view.clone()
        if param.grad is None:
            view.zero_()
        else:
            self._copy_in(pos, param.grad, scale)
        self.pending -= 1
        return self.pending == 0

    def _move_in(self, pos: int, grad: Tensor | None, scale: float | None) -> None:
        view = self.views[pos]
        if grad is view:
            if scale is not None:
                view.mul_(scale)
            return
        if grad is None:
            view.zero_()
        else:
            self._copy_in(pos, grad, scale)
        self.params[pos].grad = view

    def _copy_in(self, pos: int, grad: Tensor, scale: float | None) -> None:
        if scale is None:
            self.views[pos].copy_(grad)
        else:
            # torch's reducer does the same mul_out, so the rounding is identical.
            torch.mul(grad, scale, out=self.views[pos])

    def rebind_from(self, old: Bucket, pos_in_old: int, pos: int) -> None:
        """Carry a gradient that lives in ``old`` over to this bucket, when buckets are rebuilt."""
        param = self.params[pos]
        if param.grad is old.views[pos_in_old]:
            self.views[pos].copy_(param.grad)
            param.grad = self.views[pos]
