"""One micro-batch of a step, as every source of the loop describes it to the step cycle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Micro:
    """One micro-batch of a step on this rank.

    Args:
        indices: dataset indices this rank loads (empty for a stream).
        scale: multiplies the micro-batch's mean loss so that summing over micro-batches and
            averaging over ranks gives the mean over the global batch.
        samples: samples that count (0 for the stand-in a rank without samples runs).
        first: the step's first micro-batch on this rank.
        last: the step's last micro-batch on this rank; its backward synchronizes gradients.
        consumed: the source's position once this step is done (samples of the epoch the world
            has taken, or a stream's steps in its pass); the cycle advances the source to it.
        offset: the place of its first sample in the step's global batch (the key of per-sample
            draws, run/invariant/draws.py).
    """

    indices: list[int]
    scale: float
    samples: int
    first: bool
    last: bool
    consumed: int
    offset: int = 0


def tokens_in(batch: Any, samples: int) -> int:
    """Tokens in a batch's ``samples`` samples: those of its first integer tensor of two or more
    dimensions (``(B, T)`` token ids), 0 when it has none. Shapes only: no sync."""
    found = _token_ids(batch)
    return found[0].numel() * samples if found is not None and len(found) else 0


def _token_ids(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch if batch.dim() >= 2 and not (batch.is_floating_point() or batch.is_complex()) else None
    if isinstance(batch, dict):
        batch = batch.values()
    elif not isinstance(batch, list | tuple):
        return None
    for value in batch:  # a plain loop: map and next cost a microsecond more a step
        if (found := _token_ids(value)) is not None:
            return found
    return None


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a batch (a tensor, or tuples, lists and dicts of them) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
