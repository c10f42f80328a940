"""A resumable distributed sampler whose unit is the global batch, not the rank.

Each epoch has one global permutation, drawn from (seed, epoch) alone. Step k of an epoch takes
the next ``global_batch`` entries of it, and rank r takes its contiguous slice of those. The whole
state is (epoch, consumed): the number of samples the world has taken this epoch. Because that
state says nothing about the world size, a run resumed on 1 process or on 4 continues with exactly
the samples the original run would have used next.

Compare torch's DistributedSampler: it pads each rank's share to equal length (repeating samples)
and deals samples round-robin, so its order changes with the world size and it cannot resume
mid-epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit.errors import ConfigError


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's order, from (seed, epoch) alone, within torch's 64-bit seeds (a
    large run seed would overflow ``manual_seed``; below 2**44 the value is seed * 1000003 + epoch)."""
    return (seed * 1_000_003 + epoch) % 2**64


@dataclass
class SamplerState:
    """Where the sampler is: ``consumed`` samples of epoch ``epoch`` have been taken by the world."""

    epoch: int = 0
    consumed: int = 0


class GlobalBatchSampler:
    """Hands each rank its share of every global batch, in an order fixed by (seed, epoch).

    Args:
        num_samples: size of the dataset.
        global_batch: samples per step over all ranks.
        rank: this process's global rank.
        world_size: number of ranks.
        seed: seeds the per-epoch permutation; the same on every rank.
        shuffle: permute each epoch (else dataset order).
        drop_last: skip an epoch's final partial global batch; by default it is used, so no
            sample of an epoch is ever dropped, and ranks then get unequal (possibly empty) shares.
        order: ``order(seed, epoch)`` -> the epoch's order of all sample indices, in place of a
            plain permutation (``ddpkit.data.Shards.epoch_order``: shard by shard); it must depend
            on nothing else, or a resume would not continue the same order.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        order: Callable[[int, int], torch.Tensor] | None = None,
    ) -> None:
        if num_samples < 1:
            raise ConfigError("the dataset is empty; a sampler needs at least one sample")
        if drop_last and num_samples < global_batch:
            raise ConfigError(
                f"global_batch={global_batch} exceeds the dataset's {num_samples} samples with drop_last, "
                "which would drop every batch; use a smaller global batch, or drop_last=False"
            )
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.drop_last, self.order = seed, shuffle, drop_last, order
        self.state = SamplerState()
        self._order: torch.Tensor | None = None

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            if self.order is not None:
                self._order = self.order(self.seed, self.state.epoch)
            elif self.shuffle:
                gen = torch.Generator().manual_seed(epoch_seed(self.seed, self.state.epoch))
                self._order = torch.randperm(self.num_samples, generator=gen)
            else:
                self._order = torch.arange(self.num_samples)
        return self._order

    def _epoch_done(self) -> bool:
        left = self.num_samples - self.state.consumed
        return left == 0 or (self.drop_last and left < self.global_batch)

    def next_global_batch(self) -> list[int]:
        """Dataset indices of the whole next global batch (every rank computes the same list)."""
        self._roll_over()
        start = self.state.consumed
        batch = self._epoch_order()[start : start + self.global_batch].tolist()
        self.state.consumed += len(batch)
        return batch

    def epoch_batches(self) -> list[list[int]]:
        """The global batches left in the current epoch (the next epoch's, once this one is done).

        Reads the state without advancing it: a loader that prefetches calls this once per epoch
        and moves the state with ``advance_to`` only as steps are really taken.
        """
        self._roll_over()
        order, start = self._epoch_order(), self.state.consumed
        stop = self.num_samples
        if self.drop_last:
            stop = start + (self.num_samples - start) // self.global_batch * self.global_batch
        return [
            order[i : min(i + self.global_batch, stop)].tolist()
            for i in range(start, stop, self.global_batch)
        ]

    def advance_to(self, consumed: int) -> None:
        """Record that the world has taken ``consumed`` samples of this epoch (rolls over at its end)."""
        self.state.consumed = consumed
        self._roll_over()

    def _roll_over(self) -> None:
        if self._epoch_done():
            self.state = SamplerState(epoch=self.state.epoch + 1)
            self._order = None

    def rank_slice(self, batch: list[int]) -> list[int]:
        """This rank's contiguous share of a global batch; shares differ by at most one sample."""
        return batch[self.rank_start(len(batch)) : self.rank_start(len(batch), self.rank + 1)]

    def rank_start(self, size: int, rank: int | None = None) -> int:
        """Where ``rank``'s share (this rank's by default) of a global batch of ``size`` begins."""
        base, extra = divmod(size, self.world_size)
        rank = self.rank if rank is None else rank
        return rank * base + min(rank, extra)

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def state_dict(self) -> dict:
        return {
            "epoch": self.state.epoch,
            "consumed": self.state.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; refuses one saved for another dataset or seed."""
        for key in ("seed", "num_samples"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"checkpoint sampler has {key}={state[key]} but this run has {key}={getattr(self, key)}; "
                    "resume with the same dataset and --seed, or start a new --out"
                )
        self.state = SamplerState(epoch=state["epoch"], consumed=state["consumed"])
        self._order = None


def weighted_order(weights: Any, num_samples: int) -> Callable[[int, int], torch.Tensor]:
    """An epoch order that draws ``num_samples`` indices with replacement, index i with probability
    ``weights[i] / sum(weights)``, from (seed, epoch) alone: what torch's WeightedRandomSampler
    draws, but the same global batches on any world size and after a resume (``order=`` above)."""
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if len(w) != num_samples:
        raise ConfigError(
            f"weights has {len(w)} values for {num_samples} samples; give one weight per sample"
        )
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not float(w.sum()) > 0:
        raise ConfigError("weights must be finite, non-negative and not all 0")

    def order(seed: int, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(epoch_seed(seed, epoch))
        return torch.multinomial(w, num_samples, replacement=True, generator=gen)

    return order
