"""The checks of what a user hands ``run.loader``: a dataset, a stream or a DataLoader, and
DataLoader arguments, each refused in one line that names the value and the fix.

``loader_parts`` turns them into the parts of the source ``run/data/loader.py`` builds: the dataset,
the global batch, the DataLoader arguments torch would accept, whether to shuffle and whether to
drop the last partial global batch. A DataLoader's own settings are read in
``run/data/from_dataloader.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddpkit.data.workers import check_socket_dir
from ddpkit.errors import ConfigError
from ddpkit.run.config import DataConfig
from ddpkit.run.data.from_dataloader import agreed, check_generator, take_over


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


# The DataLoader arguments run.loader takes, and torch's defaults for them.
_DEFAULTS = {
    "num_workers": 0,
    "collate_fn": None,
    "pin_memory": False,
    "timeout": 0,
    "worker_init_fn": None,
    "multiprocessing_context": None,
    "persistent_workers": False,
    "prefetch_factor": None,
    "pin_memory_device": "",
    "in_order": True,
}


@dataclass(frozen=True)
class Parts:
    """What ``run.loader``'s source is built from.

    Args:
        dataset: the map-style dataset or the stream.
        global_batch: samples per optimizer step over all ranks.
        kwargs: the arguments of the DataLoader the source builds (workers, collate_fn, ...).
        shuffle: draw a new order each epoch.
        drop_last: skip each epoch's final partial global batch.
        batch_size_taken: the global batch is the batch_size of the user's DataLoader.
    """

    dataset: Any
    global_batch: int
    kwargs: dict
    shuffle: bool
    drop_last: bool
    batch_size_taken: bool


def loader_parts(
    data: Dataset | DataLoader, cfg: DataConfig, device: torch.device, kwargs: dict, seed: int
) -> Parts:
    """The parts of ``run.loader(data, **kwargs)``: a Dataset's, or a user's DataLoader's (its
    settings carried over, ``run.loader``'s keywords over them)."""
    shuffle, drop_last, global_batch = cfg.shuffle, cfg.drop_last, cfg.global_batch
    taken = take_over(data) if isinstance(data, DataLoader) else None
    if taken is not None:
        kwargs = {**taken.kwargs, **kwargs}
        if not is_stream(taken.dataset):  # a stream's passes end at the last full global batch
            shuffle = agreed("shuffle", cfg.shuffle, taken.shuffle)
            drop_last = agreed("drop_last", cfg.drop_last, taken.drop_last)
        global_batch, data = global_batch or taken.batch_size, taken.dataset
    if not is_stream(data) and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ConfigError(
            f"run.loader needs a dataset (__len__ and __getitem__) or an iterable, got {type(data).__name__}"
        )
    if global_batch is None:
        raise ConfigError("ddpkit.Run needs global_batch=N (samples per optimizer step over all ranks)")
    return Parts(
        data,
        global_batch,
        _loading(kwargs, device, seed),
        shuffle is not False,  # None: a dataset given bare is shuffled
        bool(drop_last),
        taken is not None and cfg.global_batch is None,
    )


def _loading(kwargs: dict, device: torch.device, seed: int) -> dict:
    """The DataLoader arguments of the source, from ``run.loader``'s keywords (and a DataLoader's)."""
    check_generator(kwargs.pop("generator", None), seed)
    kwargs.setdefault("pin_memory", device.type == "cuda")
    unknown = sorted(set(kwargs) - set(_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"run.loader got unknown arguments {unknown}; it takes {sorted([*_DEFAULTS, 'generator'])}"
        )
    return dataloader_kwargs(**{**_DEFAULTS, **kwargs})


def dataloader_kwargs(
    num_workers: int,
    collate_fn: Callable | None,
    pin_memory: bool,
    timeout: float,
    worker_init_fn: Callable | None,
    multiprocessing_context: Any,
    persistent_workers: bool,
    prefetch_factor: int | None,
    pin_memory_device: str,
    in_order: bool,
) -> dict:
    """The DataLoader arguments ``run.loader`` passes through, checked as torch would, but in one line."""
    _check_loading(num_workers, timeout, persistent_workers, prefetch_factor, in_order)
    kwargs = {
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "timeout": timeout,
        "worker_init_fn": worker_init_fn,
        "multiprocessing_context": multiprocessing_context,
        "persistent_workers": persistent_workers,
        "pin_memory_device": pin_memory_device,
    }
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    if prefetch_factor is not None:
        kwargs["prefetch_factor"] = prefetch_factor
    return kwargs


def _check_loading(
    num_workers: int, timeout: float, persistent_workers: bool, prefetch_factor: int | None, in_order: bool
) -> None:
    if num_workers < 0:
        raise ConfigError(f"num_workers={num_workers} is below 0; use 0 (load in this process) or more")
    if num_workers == 0 and (persistent_workers or prefetch_factor is not None):
        raise ConfigError("persistent_workers and prefetch_factor need num_workers >= 1")
    if timeout < 0:
        raise ConfigError(f"timeout={timeout} is below 0; use 0 (wait as long as it takes) or seconds")
    if not in_order:
        # The source pairs each batch that comes out with the micro-batch it planned (its step, its
        # share of the global batch): a batch out of order would be counted in another step.
        raise ConfigError(
            "in_order=False lets workers hand batches out of order, and run.loader counts batches "
            "into steps by their order; leave in_order=True (the default)"
        )
    check_socket_dir(num_workers)
