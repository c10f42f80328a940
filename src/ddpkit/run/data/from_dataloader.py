"""What ``run.loader`` keeps of a DataLoader the user built: every setting is carried over, or
refused in one line that names it and the fix.

A DataLoader's settings fall in two kinds here. Those of batching become the run's global-batch
sampler and mean what they meant in the single-device script: ``batch_size`` is the global batch
(the samples of one optimizer step, now over all ranks), ``shuffle`` and ``drop_last`` apply to
global batches, and the order is drawn from (``ddpkit.Run(seed=)``, epoch), the same on any world
size. Those of loading (workers, ``collate_fn``, pinning, ``timeout``, ...) are handed to the
DataLoader the run builds. What cannot keep its meaning (a sampler of its own, no automatic
batching, a generator seeded otherwise than the run) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)

from ddpkit.errors import ConfigError

# The loading settings, handed as they are to the DataLoader the run builds (prefetch_factor too,
# when there are workers: torch refuses it without).
LOADING = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


@dataclass(frozen=True)
class Taken:
    """A user's DataLoader as ``run.loader`` reads it.

    Args:
        dataset: its dataset.
        batch_size: its batch_size, the global batch unless ``ddpkit.Run`` sets one.
        shuffle: whether it shuffles (a RandomSampler, as ``shuffle=True`` makes).
        drop_last: whether it drops the last partial batch.
        kwargs: its loading settings, as DataLoader arguments (``generator`` among them when set).
    """

    dataset: Any
    batch_size: int
    shuffle: bool
    drop_last: bool
    kwargs: dict


def take_over(loader: DataLoader) -> Taken:
    """The settings of ``loader``, each one checked: refused in one line where ddpkit cannot keep it."""
    if not isinstance(loader.dataset, IterableDataset):  # a stream's DataLoader has no sampler to replace
        _check_sampler(loader)
    if loader.batch_size is None:
        raise ConfigError(
            "the DataLoader has batch_size=None (no automatic batching: one sample at a time); "
            "run.loader batches by the global batch: build it with batch_size=N (samples per "
            "optimizer step over all processes), or give ddpkit.Run(global_batch=N)"
        )
    kwargs = {name: getattr(loader, name) for name in LOADING}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    generator = loader.generator or getattr(loader.sampler, "generator", None)
    if generator is not None:
        kwargs["generator"] = generator
    shuffle = isinstance(loader.sampler, RandomSampler)
    return Taken(loader.dataset, loader.batch_size, shuffle, loader.drop_last, kwargs)


def _check_sampler(loader: DataLoader) -> None:
    """Refuse a sampler or batch sampler of the user's own: the run's replaces it."""
    sampler, batches = loader.sampler, loader.batch_sampler
    if isinstance(sampler, WeightedRandomSampler):
        raise ConfigError(
            "run.loader replaces the DataLoader's WeightedRandomSampler with ddpkit's global-batch sampler; "
            "pass the weights instead: run.loader(dataset, weights=sampler.weights), drawn from (seed, epoch)"
        )
    if loader.batch_size is None and batches is not None:  # built with batch_sampler=
        raise ConfigError(
            f"run.loader replaces the DataLoader's batch_sampler ({type(batches).__name__}) with ddpkit's "
            "global-batch sampler; build the DataLoader with batch_size, shuffle and drop_last instead"
        )
    if not isinstance(sampler, RandomSampler | SequentialSampler):
        raise ConfigError(
            f"run.loader replaces the DataLoader's sampler ({type(sampler).__name__}) with ddpkit's "
            "global-batch sampler; build the DataLoader with batch_size and shuffle only, no sampler="
        )
    if isinstance(sampler, RandomSampler) and (
        sampler.replacement or sampler.num_samples != len(sampler.data_source)
    ):
        raise ConfigError(
            "the DataLoader's RandomSampler draws with replacement or another num_samples, where "
            "run.loader draws each epoch as a permutation of the dataset; build the DataLoader with "
            "shuffle=True, or draw with replacement by run.loader(dataset, weights=torch.ones(len(dataset)))"
        )


def agreed(name: str, run_value: bool | None, loader_value: bool) -> bool:
    """The DataLoader's ``shuffle`` or ``drop_last``; refused in one line when ``ddpkit.Run`` was
    given the other value, since one of the two would be dropped without a word."""
    if run_value is not None and run_value != loader_value:
        raise ConfigError(
            f"ddpkit.Run({name}={run_value}) but the DataLoader given to run.loader has "
            f"{name}={loader_value}; set it in one place: DataLoader(..., {name}={run_value}), "
            f"or leave {name} out of ddpkit.Run"
        )
    return loader_value


def check_generator(generator: torch.Generator | None, seed: int) -> None:
    """A DataLoader's ``generator=`` is taken only when seeded as the run is: the order is drawn
    from (``ddpkit.Run(seed=)``, epoch), the same on every rank and any world size."""
    if generator is not None and generator.initial_seed() != seed:
        raise ConfigError(
            f"the DataLoader's generator has seed {generator.initial_seed()}, but run.loader draws the "
            f"order from ddpkit.Run(seed={seed}) (the same on any world size): give "
            f"ddpkit.Run(seed={generator.initial_seed()}), or build the DataLoader without generator="
        )


def batch_size_line(batch_size: int, world_size: int, micro_batch: int | None) -> str:
    """What the DataLoader's ``batch_size`` means here, with this run's numbers, in one line."""
    share = batch_size // world_size
    micro = min(micro_batch or share, share)
    processes = "the 1 process" if world_size == 1 else f"all {world_size} processes"
    return (
        f"the DataLoader's batch_size={batch_size} is the global batch (samples per optimizer step "
        f"over {processes}): {share} a process, in micro-batches of {micro}; for {batch_size} a "
        f"process, give ddpkit.Run(global_batch={batch_size * world_size})"
    )
