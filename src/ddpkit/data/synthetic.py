"""Synthetic regression data for ToyModel: learnable, deterministic, and free of files."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ddpkit.errors import ConfigError

IN_FEATURES = 10
OUT_FEATURES = 5


class ToyDataset(Dataset):
    """Pairs (x, y) with x ~ N(0, I) of shape (10,) and y = x @ W + b + noise of shape (5,).

    Everything comes from one generator seeded with ``seed``, so every rank that builds
    the dataset with the same seed holds the same examples, which a DistributedSampler
    relies on to hand out disjoint shards.

    Args:
        num_samples: Number of examples.
        seed: Seed for the inputs, the linear map and the noise.
        noise_std: Standard deviation of the Gaussian noise added to y.

    Raises:
        ConfigError: If ``num_samples`` is not positive or ``noise_std`` is negative.
    """

    draws_random = False  # its samples are fixed: run.loader need not seed them

    def __init__(self, num_samples: int = 1024, seed: int = 0, noise_std: float = 0.01) -> None:
        if num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {num_samples}")
        if noise_std < 0:
            raise ConfigError(f"noise_std must be >= 0, got {noise_std}")
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(IN_FEATURES, OUT_FEATURES, generator=gen) / IN_FEATURES**0.5
        bias = torch.randn(OUT_FEATURES, generator=gen) * 0.1
        self.x = torch.randn(num_samples, IN_FEATURES, generator=gen)  # (N, 10)
        noise = torch.randn(num_samples, OUT_FEATURES, generator=gen) * noise_std
        self.y = self.x @ weight + bias + noise  # (N, 5)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]
