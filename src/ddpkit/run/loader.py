"""``run.loader(dataset)``: torch's DataLoader, fed one global batch per step by GlobalBatchSampler.

Each epoch is planned in advance: the global batches left in it, this rank's slice of each, that
slice cut into micro-batches. The DataLoader gets the plan's index lists as its batch sampler
(its workers may prefetch as far ahead as they like), and the loader walks the same plan as
batches come out, so it knows for every micro-batch which step it belongs to, whether it is the
step's last, and how many samples the world will have consumed once that step is done. Only
that consumed count goes into a checkpoint, never what the workers prefetched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.errors import ConfigError
from ddpkit.run.seeding import SeededFetch

if TYPE_CHECKING:
    from ddpkit.run.run import Run


@dataclass(frozen=True)
class DataConfig:
    """How the training data is cut into steps.

    Args:
        global_batch: samples per optimizer step over all ranks (None: the batch_size of the
            DataLoader given to ``run.loader``); must split evenly over the ranks.
        micro_batch: samples per forward/backward on one rank; below the rank's share of the
            global batch it means gradient accumulation. None: the whole share at once.
        drop_last: skip each epoch's final partial global batch (by default it is used).
        shuffle: a new order each epoch, drawn from (seed, epoch) alone.
    """

    global_batch: int | None = None
    micro_batch: int | None = None
    drop_last: bool = False
    shuffle: bool = True

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r} must be a positive integer (or None)")


@dataclass(frozen=True)
class Micro:
    """One micro-batch of the plan.

    Args:
        indices: dataset indices this rank loads.
        scale: multiplies the micro-batch's mean loss so that summing over micro-batches and
            averaging over ranks gives the mean over the global batch.
        samples: samples that count (0 for the stand-in a rank without samples runs).
        first: the step's first micro-batch on this rank.
        last: the step's last micro-batch on this rank; its backward synchronizes gradients.
        consumed: samples of the epoch the world has taken once this step is done.
    """

    indices: list[int]
    scale: float
    samples: int
    first: bool
    last: bool
    consumed: int


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
        chunks = [mine[i : i + size] for i in range(0, len(mine), size)]
        for i, chunk in enumerate(chunks):
            # chunk mean * len(chunk) is the chunk's sum; / len(batch) its share of the global
            # mean; * world_size undoes the engine's average over ranks.
            scale = weight * len(chunk) * sampler.world_size / len(batch)
            plan.append(Micro(chunk, scale, int(weight) * len(chunk), i == 0, i == len(chunks) - 1, consumed))
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


class Loader:
    """Iterates this rank's micro-batches, on the run's device, for the rest of the current epoch.

    ``for batch in loader`` runs one epoch (the rest of it after a resume); the next ``for``
    runs the next epoch, so there is no ``set_epoch`` to forget. ``loader.epoch`` is the epoch
    the next ``for`` runs, which makes ``for epoch in range(loader.epoch, epochs)`` resume right.
    Built by ``Run.loader``; see there for the arguments.
    """

    def __init__(
        self,
        run: Run,
        dataset: Dataset,
        sampler: GlobalBatchSampler,
        micro_batch: int | None,
        dataloader_kwargs: dict,
    ) -> None:
        self.run, self.sampler, self.micro_batch = run, sampler, micro_batch
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
        """The epoch that the next ``for batch in loader`` runs (0-based)."""
        return self.sampler.state.epoch

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch: global batches, the last partial one included unless drop_last."""
        return self.sampler.steps_per_epoch

    def __len__(self) -> int:
        """Optimizer steps in one epoch (``steps_per_epoch``): the same number at every point of a
        run, before and after a resume, on any world size and with any ``micro_batch``.

        What a single-device loop's ``len(loader)`` means (one optimizer step per batch), so
        ``epochs * len(loader)`` sizes a schedule right. Iterating yields micro-batches: with
        ``micro_batch`` below a rank's share of the global batch, more than ``len`` of them.
        """
        return self.sampler.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        self.run._start_epoch()
        plan = plan_epoch(self.sampler, self.micro_batch)  # rolls over to the next epoch when due
        self._plan_sampler.plan, self._plan_sampler.epoch = plan, self.epoch
        self.dataloader.dataset.draws = None  # test again, each epoch, whether the dataset draws
        self._generator.manual_seed(hash((self.sampler.seed, self.epoch, self.sampler.state.consumed)))
        batches = iter(self.dataloader)
        cycle, device = self.run.cycle, self.run.device
        done = -(-self.sampler.state.consumed // self.sampler.global_batch)  # steps taken this epoch
        self.run.monitor.epoch_started(self.epoch, done, self.steps_per_epoch, cycle.steps)
        move = device.type != "cpu"  # the DataLoader's batches are on the CPU already
        for micro in plan:
            if micro.first and not cycle.begin(self):
                return  # the run's step limit is reached
            batch = self.run._fetch(batches)
            cycle.enter(micro)
            yield to_device(batch, device) if move else batch
        cycle.finish()
        cycle.outside = True

    def _advance_to(self, consumed: int) -> None:
        """The step that took the world to ``consumed`` samples of this epoch is done."""
        self.sampler.advance_to(consumed)

    def state_dict(self) -> dict:
        """The position: samples of the current epoch the world has consumed (not prefetched)."""
        return {**self.sampler.state_dict(), "global_batch": self.sampler.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; refuses one saved with another global batch."""
        if state["global_batch"] != self.sampler.global_batch:
            raise ConfigError(
                f"the checkpoint was made with global_batch={state['global_batch']}, this run has "
                f"{self.sampler.global_batch}; resume with the same global batch, or start another out"
            )
        self.sampler.load_state_dict({k: v for k, v in state.items() if k != "global_batch"})


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


def dataloader_kwargs(
    num_workers: int,
    collate_fn: Callable | None,
    pin_memory: bool,
    persistent_workers: bool,
    prefetch_factor: int | None,
    worker_init_fn: Callable | None,
    multiprocessing_context: Any,
) -> dict:
    """The DataLoader arguments ``run.loader`` passes through, checked as torch would, but in one line."""
    if num_workers < 0:
        raise ConfigError(f"num_workers={num_workers} is below 0; use 0 (load in this process) or more")
    if num_workers == 0 and (persistent_workers or prefetch_factor is not None):
        raise ConfigError("persistent_workers and prefetch_factor need num_workers >= 1")
    kwargs = {
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "persistent_workers": persistent_workers,
        "worker_init_fn": worker_init_fn,
        "multiprocessing_context": multiprocessing_context,
    }
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    if prefetch_factor is not None:
        kwargs["prefetch_factor"] = prefetch_factor
    return kwargs
