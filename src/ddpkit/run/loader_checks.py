"""The checks of what a user hands ``run.loader``: a dataset, a stream or a DataLoader, and
DataLoader arguments, each refused in one line that names the value and the fix.

``loader_parts`` turns them into the parts of the source ``run/loader.py`` builds: the dataset,
the global batch, the DataLoader arguments torch would accept, and whether to shuffle.
"""

from __future__ import annotations

from collections.abc import Callable
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

from ddpkit.data.workers import check_socket_dir
from ddpkit.errors import ConfigError
from ddpkit.run.config import DataConfig


def check_stream(stream: Any, weights: Any, inexact: bool) -> int | None:
    """Refuse what a stream cannot resume exactly: ``weights=``, or a shuffle buffer without
    ``inexact_resume=True``. Returns that buffer's size (None: the stream has none)."""
    if weights is not None:
        raise ConfigError("run.loader(weights=...) needs a map-style dataset; a stream has no indices")
    if (buffer := shuffle_buffer(stream)) is not None and not inexact:
        raise ConfigError(
            f"this datasets stream is shuffled with .shuffle(buffer_size={buffer}), whose buffer is "
            "not in its state_dict: a resumed run would skip up to that many samples a rank and "
            "read others in another order; shuffle before streaming "
            "(Dataset.shuffle(seed).to_iterable_dataset()), or use ddpkit.data.Shards, or pass "
            "run.loader(..., inexact_resume=True) to accept it"
        )
    return buffer


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
