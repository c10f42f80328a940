"""Flat buffers: many tensors as one 1-D tensor, so one collective moves them all."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """A new 1-D tensor holding ``tensors`` one after another (an empty one for none).

    Args:
        tensors: tensors of one dtype and device; any shapes, contiguous or not.
    """
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: Tensor, like: Sequence[Tensor | torch.Size]) -> list[Tensor]:
    """Views into ``flat``, one per entry of ``like``, shaped like it, in order.

    Writing through a view writes ``flat``; nothing is copied. This is how a bucket's
    parameters see their part of the flat gradient buffer.

    Args:
        flat: a 1-D tensor at least as long as the entries together.
        like: tensors or shapes giving each view's shape.
    """
    views, offset = [], 0
    for item in like:
        shape = item.shape if isinstance(item, Tensor) else torch.Size(item)
        numel = shape.numel()
        views.append(flat[offset : offset + numel].view(shape))
        offset += numel
    assert offset <= flat.numel(), f"unflatten: {offset} elements wanted from a buffer of {flat.numel()}"
    return views
