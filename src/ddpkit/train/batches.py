"""From dataset indices to tensors on the device, split into micro-batches."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate


def micro_batches(indices: list[int], size: int | None) -> list[list[int]]:
    """Split a rank's share into chunks of ``size`` (the last may be smaller); None: one chunk."""
    if size is None or size >= len(indices):
        return [indices]
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def collate(dataset: Dataset, indices: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """Fetch and stack (input, target) pairs and move them to ``device``."""
    x, y = default_collate([dataset[i] for i in indices])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
