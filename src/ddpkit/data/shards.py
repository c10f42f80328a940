"""A dataset stored as shards (files, or any units a reader opens), addressed sample by sample.

``Shards`` turns a list of shards and a reader into a map-style dataset whose epoch order is
decided by the run's seed, the epoch and the shard index alone: shards in an order drawn from
(seed, epoch), each shard's samples in an order drawn from (seed, epoch, shard). ``run.loader``
then cuts that one global order into global batches exactly as it does for any dataset, so the
same global batches come out at any world size, and a run resumed on another world size goes on
with the samples it would have used next (Mosaic Streaming's promise, here bit-exact). Reading
stays sequential: a micro-batch is a run of consecutive samples, mostly of one shard, and each
process (a DataLoader worker included) keeps the shard it read last.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from ddpkit.errors import ConfigError


class Shards(Dataset):
    """Samples of ``shards``, read shard by shard with ``read``.

    Args:
        shards: the shards: file paths, URLs, or anything ``read`` takes; their order here is
            the shard index.
        read: ``read(shard)`` -> the shard's samples, a sequence (a list, an array, a tensor).
            Called once per shard and process while its samples are being used.
        sizes: samples in each shard. None: every shard is read once, at construction, to count.
        shuffle: shuffle the shard order and the samples in each shard every epoch; False keeps
            both in order.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        read: Callable[[Any], Sequence[Any]],
        sizes: Sequence[int] | None = None,
        shuffle: bool = True,
    ) -> None:
        if len(shards) == 0:
            raise ConfigError("Shards got no shards; pass the list of shard files (or units) to read")
        self.shards, self.read, self.shuffle = list(shards), read, shuffle
        sizes = [len(read(shard)) for shard in self.shards] if sizes is None else list(sizes)
        if len(sizes) != len(self.shards) or any(s < 0 for s in sizes):
            raise ConfigError(
                f"Shards: sizes must give one count >= 0 per shard ({len(self.shards)}), got {sizes}"
            )
        self.sizes = sizes
        self.starts = list(itertools.accumulate(sizes, initial=0))  # the first index of each shard
        self._cached: tuple[int, Sequence[Any]] | None = None  # (shard index, its samples)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> Any:
        shard = bisect.bisect_right(self.starts, index) - 1
        if self._cached is None or self._cached[0] != shard:
            samples = self.read(self.shards[shard])
            if len(samples) != self.sizes[shard]:
                raise ConfigError(
                    f"shard {self.shards[shard]!r} holds {len(samples)} samples, not the {self.sizes[shard]} "
                    "given in sizes; pass the right sizes (or sizes=None to count them)"
                )
            self._cached = (shard, samples)
        return self._cached[1][index - self.starts[shard]]

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        """Every sample index once: shards in an order drawn from (seed, epoch), and each shard's
        samples in one drawn from (seed, epoch, shard). Nothing else enters: not the world size."""
        if not self.shuffle:
            return torch.arange(len(self))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        parts = []
        for shard in torch.randperm(len(self.shards), generator=gen).tolist():
            inner = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_033 + shard)
            parts.append(self.starts[shard] + torch.randperm(self.sizes[shard], generator=inner))
        return torch.cat(parts)
