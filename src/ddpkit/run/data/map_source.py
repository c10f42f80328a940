"""A map-style dataset as a source of the loop's micro-batches: torch's DataLoader, fed one
global batch per step by GlobalBatchSampler.

Each epoch is planned in advance: the global batches left in it, this rank's slice of each, that
slice cut into micro-batches. The DataLoader gets the plan's index lists as its batch sampler
(its workers may prefetch as far ahead as they like), and the source walks the same plan as
batches come out, so it knows for every micro-batch which step it belongs to, whether it is the
step's last, and how many samples the world will have consumed once that step is done. Only
that consumed count goes into a checkpoint, never what the workers prefetched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.errors import ConfigError
from ddpkit.run.config import check_same_global_batch
from ddpkit.run.invariant.seeding import SeededFetch
from ddpkit.run.micro import Micro


def plan_epoch(sampler: GlobalBatchSampler, micro_batch: int | None) -> list[Micro]:
    """This rank's micro-batches for the rest of the sampler's current epoch."""
    plan, consumed = [], sampler.state.consumed
    for batch in sampler.epoch_batches():
        consumed += len(batch)
        mine = sampler.rank_slice(batch)
        # A rank left without samples (an epoch's last, partial batch) still joins the gradient
        # all-reduce, with one sample at weight 0, or the other ranks would wait for it forever.
        weight, mine = (1.0, mine) if mine else (0.0, batch[:1])
        size = micro_batch or len(mine)
        start = sampler.rank_start(len(batch)) if weight else 0  # a stand-in's labels stay in range
        chunks = [mine[i : i + size] for i in range(0, len(mine), size)]
        for i, chunk in enumerate(chunks):
            # chunk mean * len(chunk) is the chunk's sum; / len(batch) its share of the global
            # mean; * world_size undoes the engine's average over ranks.
            scale = weight * len(chunk) * sampler.world_size / len(batch)
            first, last = i == 0, i == len(chunks) - 1
            plan.append(
                Micro(chunk, scale, int(weight) * len(chunk), first, last, consumed, start + i * size)
            )
    return plan


class EpochIndices(list):
    """A micro-batch's dataset indices, carrying the epoch they are drawn in to the fetch."""

    epoch: int = 0


class _PlanSampler:
    """The batch sampler the DataLoader iterates: the index lists of the current plan."""

    def __init__(self) -> None:
        self.plan: list[Micro] = []
        self.epoch = 0

    def __iter__(self) -> Iterator[list[int]]:
        for micro in self.plan:
            indices = EpochIndices(micro.indices)
            indices.epoch = self.epoch
            yield indices

    def __len__(self) -> int:
        return len(self.plan)


class MapSource:
    """This rank's micro-batches of a map-style dataset, epoch by epoch, and its position.

    Args:
        dataset: the map-style dataset.
        sampler: the run's GlobalBatchSampler over it (its state is the position).
        micro_batch: samples per forward/backward on one rank; None: the whole share.
        dataloader_kwargs: torch DataLoader arguments (workers, collate_fn, pinning, ...).
        grains: a bitwise run's grains (its position holds them: a resume must cut alike).
    """

    per_rank_state = False  # the position is the world's, the same on every rank
    agreement = None  # no collective before a step: every rank knows the epoch's steps

    def __init__(
        self,
        dataset: Dataset,
        sampler: GlobalBatchSampler,
        micro_batch: int | None,
        dataloader_kwargs: dict,
        grains: int | None = None,
    ) -> None:
        self.sampler, self.micro_batch, self.grains = sampler, micro_batch, grains
        self._plan_sampler = _PlanSampler()
        # The DataLoader draws its workers' base seed from this generator, not the global one,
        # so creating an iterator (at a resume, say) does not shift the training RNG stream.
        self._generator = torch.Generator()
        self.dataloader = DataLoader(
            SeededFetch(dataset, sampler.seed),
            batch_sampler=self._plan_sampler,
            generator=self._generator,
            **dataloader_kwargs,
        )

    @property
    def epoch(self) -> int:
        """The epoch that the next pass runs (0-based)."""
        return self.sampler.state.epoch

    @property
    def global_batch(self) -> int:
        return self.sampler.global_batch

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch, the last partial one included unless drop_last."""
        return self.sampler.steps_per_epoch

    @property
    def steps_done(self) -> int:
        """Steps of the current epoch already taken."""
        return -(-self.sampler.state.consumed // self.sampler.global_batch)

    def start_pass(self) -> Iterator[tuple[Micro, Callable[[], object]]]:
        """The rest of the current epoch (the next one when it is done): each micro-batch of the
        plan with the call that fetches its batch, which the step cycle makes after opening the step."""
        plan = plan_epoch(self.sampler, self.micro_batch)  # rolls over to the next epoch when due
        self._plan_sampler.plan, self._plan_sampler.epoch = plan, self.epoch
        self._generator.manual_seed(hash((self.sampler.seed, self.epoch, self.sampler.state.consumed)))
        fetch = functools.partial(next, iter(self.dataloader))
        return ((micro, fetch) for micro in plan)

    def end_pass(self) -> None:
        """Nothing to do: the next plan rolls the sampler over to the next epoch."""

    def advance_to(self, consumed: int) -> None:
        """The step that took the world to ``consumed`` samples of this epoch is done."""
        self.sampler.advance_to(consumed)

    def state_dict(self) -> dict:
        """The position: samples of the current epoch the world has consumed (not prefetched)."""
        grains = {"grains": self.grains} if self.grains is not None else {}
        return {**self.sampler.state_dict(), "global_batch": self.sampler.global_batch, **grains}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; refuses one saved with another global batch, or grains."""
        check_same_global_batch(state["global_batch"], self.sampler.global_batch)
        if state.get("grains") != self.grains:
            then, now = (f"grains={g}" if g else "bitwise off" for g in (state.get("grains"), self.grains))
            raise ConfigError(
                f"the checkpoint was made with {then} and this run has {now}; the same bits need the "
                "same grains: resume with the settings that wrote it, or start a new out"
            )
        self.sampler.load_state_dict({k: v for k, v in state.items() if k not in ("global_batch", "grains")})
