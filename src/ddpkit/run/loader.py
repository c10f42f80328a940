"""``run.loader(data)``: the object a user's loop iterates, and what it is built from.

``Loader`` is a thin handle: ``for batch in loader`` hands the run's step cycle its source (a
``MapSource`` for a map-style dataset, a ``StreamSource`` for a stream), and the cycle drives the
pass (``StepCycle.drive``). The rest of this module turns what the user hands ``run.loader`` (a
dataset, a stream or a DataLoader, and DataLoader arguments) into that source's parts, checked
in one line each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)

from ddpkit.data.sampler import GlobalBatchSampler, weighted_order
from ddpkit.data.workers import check_socket_dir
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.config import DataConfig, check_split
from ddpkit.run.cycle import StepCycle
from ddpkit.run.map_source import MapSource
from ddpkit.run.stream import StreamSource


class Loader:
    """Iterates this rank's micro-batches, on the run's device, for the rest of the current epoch.

    ``for batch in loader`` runs one epoch (the rest of it after a resume); the next ``for``
    runs the next epoch, so there is no ``set_epoch`` to forget. ``loader.epoch`` is the epoch
    the next ``for`` runs, which makes ``for epoch in range(loader.epoch, epochs)`` resume right.
    Built by ``Run.loader``; see there for the arguments.
    """

    def __init__(self, source: MapSource | StreamSource, cycle: StepCycle) -> None:
        self._source, self._cycle = source, cycle

    @property
    def epoch(self) -> int:
        """The epoch that the next ``for batch in loader`` runs (0-based)."""
        return self._source.epoch

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self._source.global_batch

    @property
    def dataloader(self) -> DataLoader:
        """The torch DataLoader behind it (its workers, pinning and collate_fn are the user's)."""
        return self._source.dataloader

    @property
    def sampler(self) -> GlobalBatchSampler:
        """A map-style dataset's GlobalBatchSampler (a stream has none)."""
        return self._source.sampler

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one epoch (None for a stream, whose passes have no known length)."""
        return self._source.steps_per_epoch

    def __len__(self) -> int:
        """Optimizer steps in one epoch (``steps_per_epoch``): the same number at every point of a
        run, before and after a resume, on any world size and with any ``micro_batch``.

        What a single-device loop's ``len(loader)`` means (one optimizer step per batch), so
        ``epochs * len(loader)`` sizes a schedule right. Iterating yields micro-batches: with
        ``micro_batch`` below a rank's share of the global batch, more than ``len`` of them.
        """
        if self._source.steps_per_epoch is None:
            raise TypeError(
                "a stream has no length to size a schedule by: give ddpkit.Run steps=N and size it by that"
            )
        return self._source.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        return self._cycle.drive(self._source)

    def state_dict(self) -> dict:
        """The position the run's checkpoints hold (what the world consumed, not what was prefetched)."""
        return self._source.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Continue from a saved position (a checkpoint's; the run does this itself on resume)."""
        self._source.load_state_dict(state)


def make_source(
    data: Dataset | DataLoader, kwargs: dict, cfg: DataConfig, env: DistEnv, seed: int, phase: Callable
) -> MapSource | StreamSource:
    """The source of ``run.loader(data, **kwargs)``: a stream's, or a map-style dataset's over the
    run's global-batch sampler (drawn by ``weights=`` when given); ``phase`` tells the hang
    watchdog of a stream's agreement."""
    weights, inexact = kwargs.pop("weights", None), kwargs.pop("inexact_resume", False)
    dataset, global_batch, kwargs, shuffle = loader_parts(data, cfg, env.device, kwargs)
    if is_stream(dataset):
        if weights is not None:
            raise ConfigError("run.loader(weights=...) needs a map-style dataset; a stream has no indices")
        if (buffer := shuffle_buffer(dataset)) is not None and not inexact:
            raise ConfigError(
                f"this datasets stream is shuffled with .shuffle(buffer_size={buffer}), whose buffer is "
                "not in its state_dict: a resumed run would skip up to that many samples a rank and "
                "read others in another order; shuffle before streaming "
                "(Dataset.shuffle(seed).to_iterable_dataset()), or use ddpkit.data.Shards, or pass "
                "run.loader(..., inexact_resume=True) to accept it"
            )
        check_split(global_batch, env.world_size)
        source = StreamSource(env, dataset, global_batch, cfg.micro_batch, kwargs, phase)
        source.inexact_buffer = buffer
        return source
    sampler = make_sampler(dataset, global_batch, env, cfg, seed, shuffle, weights)
    return MapSource(dataset, sampler, cfg.micro_batch, kwargs)


def shuffle_buffer(stream: Any) -> int | None:
    """The buffer size of a HuggingFace stream shuffled with ``.shuffle(buffer_size=N)``, whose
    ``state_dict`` leaves the buffer out (``datasets`` refills it on load): a resumed run would
    skip up to N samples a rank and read others in another order. None for any other stream."""
    node = getattr(stream, "_ex_iterable", None)  # datasets' chain of iterables, outermost first
    while node is not None:
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return node.buffer_size
        node = getattr(node, "ex_iterable", None)
    return None


def is_stream(data: Any) -> bool:
    """An iterable source rather than a map-style dataset (or a DataLoader over one)."""
    data = data.dataset if isinstance(data, DataLoader) else data
    return isinstance(data, IterableDataset) or (
        hasattr(data, "__iter__") and not hasattr(data, "__getitem__")
    )


# DataLoader attributes that run.loader carries over from a DataLoader the user built.
_CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "persistent_workers",
    "worker_init_fn",
    "multiprocessing_context",
)
_DEFAULTS = {
    "num_workers": 0,
    "collate_fn": None,
    "pin_memory": False,
    "persistent_workers": False,
    "prefetch_factor": None,
    "worker_init_fn": None,
    "multiprocessing_context": None,
}


def loader_parts(
    data: Dataset | DataLoader, cfg: DataConfig, device: torch.device, kwargs: dict
) -> tuple[Dataset, int, dict, bool]:
    """(dataset, global batch, DataLoader arguments, shuffle) from a Dataset or a user's DataLoader."""
    shuffle = cfg.shuffle
    global_batch = cfg.global_batch
    if isinstance(data, DataLoader):
        if not isinstance(data.dataset, IterableDataset):  # a stream's DataLoader has no sampler to replace
            _check_own_sampler(data)
        carried = {name: getattr(data, name) for name in _CARRIED}
        if data.num_workers > 0:
            carried["prefetch_factor"] = data.prefetch_factor
        kwargs = {**carried, **kwargs}
        shuffle = isinstance(data.sampler, RandomSampler)
        global_batch = global_batch or data.batch_size
        data = data.dataset
    if not is_stream(data) and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ConfigError(
            f"run.loader needs a dataset (__len__ and __getitem__) or an iterable, got {type(data).__name__}"
        )
    if global_batch is None:
        raise ConfigError("ddpkit.Run needs global_batch=N (samples per optimizer step over all ranks)")
    kwargs.setdefault("pin_memory", device.type == "cuda")
    unknown = sorted(set(kwargs) - set(_DEFAULTS))
    if unknown:
        raise ConfigError(f"run.loader got unknown arguments {unknown}; it takes {sorted(_DEFAULTS)}")
    return data, global_batch, dataloader_kwargs(**{**_DEFAULTS, **kwargs}), shuffle


def _check_own_sampler(loader: DataLoader) -> None:
    if isinstance(loader.sampler, WeightedRandomSampler):
        raise ConfigError(
            "run.loader replaces the DataLoader's WeightedRandomSampler with ddpkit's global-batch sampler; "
            "pass the weights instead: run.loader(dataset, weights=sampler.weights), drawn from (seed, epoch)"
        )
    sampler_ok = isinstance(loader.sampler, RandomSampler | SequentialSampler)
    if not sampler_ok or not isinstance(loader.batch_sampler, BatchSampler | None):
        raise ConfigError(
            f"run.loader replaces the DataLoader's sampler ({type(loader.sampler).__name__}) with ddpkit's "
            "global-batch sampler; build the DataLoader with batch_size and shuffle only, no sampler="
        )


def make_sampler(
    dataset: Dataset,
    global_batch: int,
    env: DistEnv,
    cfg: DataConfig,
    seed: int,
    shuffle: bool,
    weights: Any = None,
) -> GlobalBatchSampler:
    """The run's GlobalBatchSampler, after checking that the global batch splits over the ranks."""
    check_split(global_batch, env.world_size)
    order = getattr(dataset, "epoch_order", None)  # ddpkit.data.Shards: shard by shard
    if weights is not None:
        order = weighted_order(weights, len(dataset))
    return GlobalBatchSampler(
        len(dataset),
        global_batch,
        env.rank,
        env.world_size,
        seed=seed,
        shuffle=shuffle,
        drop_last=cfg.drop_last,
        order=order,
    )


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
    check_socket_dir(num_workers)
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
