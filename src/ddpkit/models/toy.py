"""The two-layer network from PyTorch's DDP tutorial, used for smoke runs and engine tests."""

from __future__ import annotations

import torch
from torch import nn


class ToyModel(nn.Module):
    """Linear(10, 10) -> ReLU -> Linear(10, 5), as in the PyTorch DDP tutorial.

    Small enough that a step is dominated by communication, which makes it the model of
    choice for checking gradient synchronization rather than for learning anything.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map a batch of 10-dim inputs to 5-dim outputs.

        Args:
            x: Inputs of shape (B, 10).

        Returns:
            Outputs of shape (B, 5).
        """
        return self.net2(self.relu(self.net1(x)))
