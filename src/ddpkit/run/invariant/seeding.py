"""Random transforms in a dataset, seeded per sample: the same draws at any world size.

A single-device script's augmentation (a random flip in ``__getitem__``) draws from the global
generators of whichever process fetches the sample. Under data parallelism that process, its
position in its stream and the other samples of its batch all depend on the world size and the
micro-batch, so the draws would too. ``SeededFetch`` seeds each generator the dataset draws from
(python's, numpy's, torch's CPU one, its own) from (run seed, epoch, sample index) before each
sample instead, through each library's public seeding and state accessors.

``ddpkit.sample_rng()`` (``run/invariant/sample_rng.py``) is the fast path: generators of the sample's own,
which a dataset draws from explicitly, so that nothing global need be watched or put back.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, StackDataset, Subset, TensorDataset, get_worker_info

from ddpkit.errors import ConfigError
from ddpkit.run.invariant.generators import (
    PROCESS_LOCK,
    Twins,
    keeper,
    owned_generators,
    process_generators,
    seeder,
)
from ddpkit.run.invariant.sample_rng import fetching, sample_seed


def seed_everything(seed: int) -> None:
    """The same seed on every rank: identical model init, so the engine's broadcast changes nothing."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def declared_draws(dataset: Dataset) -> bool | str:
    """What a dataset's ``__getitem__`` can draw from: False for nothing (torch's
    ``TensorDataset``, a list, tuple or dict of samples), "sample_rng" for ``ddpkit.sample_rng()``
    alone, True for anything (watched). A class says so itself with ``draws_random = False`` (ddpkit's
    own) or ``draws_random = "sample_rng"``, exactly that class: a subclass may add a random
    transform. ``Subset``/``ConcatDataset``/``StackDataset`` draw what their parts do."""
    kind = type(dataset)
    if kind in (TensorDataset, list, tuple, dict):
        return False
    said = vars(kind).get("draws_random", True)
    if not (said is True or said is False or said == "sample_rng"):
        raise ConfigError(f"{kind.__name__}.draws_random = {said!r}: use True, False or 'sample_rng'")
    if said is not True:
        return said
    if kind is Subset:
        return declared_draws(dataset.dataset)
    parts = dataset.datasets if kind in (ConcatDataset, StackDataset) else None
    if parts is None:
        return True
    kinds = set(map(declared_draws, parts.values() if isinstance(parts, dict) else parts))
    return True if True in kinds else "sample_rng" if "sample_rng" in kinds else False


class SeededFetch(Dataset):
    """Wraps the user's dataset so that random transforms draw the same numbers for the same sample
    at any world size, any micro_batch and after a resume.

    The generators a sample can draw from are python's, numpy's legacy one, torch's CPU one and
    every generator the dataset holds as an attribute (numpy ``Generator``/``RandomState``,
    ``random.Random``, a CPU ``torch.Generator``). Those the dataset has been seen to draw from
    are seeded before each sample from (run seed, epoch, sample index, generator): which rank,
    worker or micro-batch fetches a sample no longer matters. Every batch also compares the
    others' states before and after; one that moved is added, and the batch is fetched again,
    so a draw that comes rarely (one sample in a thousand) is seeded too, never passed through.
    In a DataLoader worker the generators are the worker's own and are left seeded; in the
    training process (num_workers=0) their states are read once a batch and put back after it,
    so the model's own draws (dropout) are what they would be without data loading.

    ``ddpkit.sample_rng()`` is valid in every sample's ``__getitem__``; a class that draws from
    nothing else (``draws_random = "sample_rng"``) is fetched without any of the above.

    Costs per sample and per batch: docs/engine.md, "Per-sample seeding".
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.owned = owned_generators(dataset)
        self.drawn: set[str] = set()  # the generators the dataset has been seen to draw from
        self.draws = declared_draws(dataset)
        self.plain = self.draws is False
        self.twins = Twins()  # numpy's global's stand-in while a batch is watched

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        # Only for names the wrapper lacks: a worker_init_fn's get_worker_info().dataset.open()
        # reaches the user's dataset, as it would without the wrapper. Not "dataset" itself, nor
        # dunders: unpickling (in a spawned worker) asks for them before __dict__ is filled.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitems__(self, indices: list[int]) -> list:
        if self.plain:
            return self._plain(indices)
        with fetching(self.seed, getattr(indices, "epoch", 0)) as start:
            if self.draws == "sample_rng":  # nothing else to seed, watch or put back
                return self._each(indices, start, [])
            return self._watched(indices, start)

    def _watched(self, indices: list[int], start: Callable[[int | None], None]) -> list:
        with PROCESS_LOCK:
            return self._watched_alone(indices, start)

    def _watched_alone(self, indices: list[int], start: Callable[[int | None], None]) -> list:
        generators = process_generators(self.owned)
        in_worker = get_worker_info() is not None  # a worker's generators are its own
        watched = {name for name in generators if name not in self.drawn}
        # Read once a batch: the mark that tells whether a generator drew, and what is put back.
        kept = {
            name: keeper(g)(g, name in watched, in_worker, self.twins)
            for name, g in generators.items()
            if name in watched or not in_worker
        }
        try:
            while True:
                for name in watched:
                    kept[name].arm()
                batch = self._each(indices, start, self._seeders(generators))
                moved = {name for name in watched if kept[name].moved()}
                if not moved:
                    return batch
                self.drawn |= moved  # fetched again, those seeded per sample too
                watched -= moved
        finally:  # the training process's generators are the run's; a worker's, as it had them
            for name, one in kept.items():
                if one.changes or name in self.drawn and not in_worker:
                    one.put_back()

    def _seeders(self, generators: dict[str, Any]) -> list[tuple[int, Callable[[int], None]]]:
        """(stream, seeder) of each generator seen drawn: each its own stream of sample_seed."""
        return [(n, seeder(g)) for n, (name, g) in enumerate(generators.items()) if name in self.drawn]

    def _plain(self, indices: list[int]) -> list:
        own = getattr(self.dataset, "__getitems__", None)
        return own(indices) if own else [self.dataset[i] for i in indices]

    def _each(self, indices: list[int], start: Callable[[int | None], None], seeders: list) -> list:
        """The samples one by one, each its own ``sample_rng()``, its generators seeded first."""
        if not seeders and hasattr(self.dataset, "__getitems__"):
            return self._plain(indices)  # the dataset's own batched fetch, while nothing is seeded
        epoch, seed, batch = getattr(indices, "epoch", 0), self.seed, []
        for index in indices:
            start(index)
            for number, seed_with in seeders:
                seed_with(sample_seed(seed, epoch, index, number))
            batch.append(self.dataset[index])
        start(None)
        return batch
