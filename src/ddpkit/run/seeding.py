"""Random transforms in a dataset, seeded per sample: the same draws at any world size.

A single-device script's augmentation (a random flip in ``__getitem__``) draws from the global
generators of whichever process fetches the sample. Under data parallelism that process, its
position in its stream and the other samples of its batch all depend on the world size and the
micro-batch, so the draws would too. ``SeededFetch`` seeds each generator the dataset draws from
(python's, numpy's, torch's CPU one, its own) from (run seed, epoch, sample index) before each
sample instead.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, StackDataset, Subset, TensorDataset, get_worker_info

from ddpkit.run.raw_state import pcg64_seeder, restore, snapshot


def seed_everything(seed: int) -> None:
    """The same seed on every rank: identical model init, so the engine's broadcast changes nothing."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


_MASK = 2**64 - 1


def sample_seed(seed: int, epoch: int, index: int, stream: int = 0) -> int:
    """The seed of one sample's draws from one generator (``stream``): (run seed, epoch, sample
    index, generator) alone, mixed by splitmix64's finalizer (0.45 us, against 0.96 us for blake2b)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB + stream) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


GENERATOR_TYPES = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)


def owned_generators(dataset: Dataset) -> dict[str, Any]:
    """The generators a dataset holds as attributes (``self.rng = np.random.default_rng()``): its
    draws come from them, not from the global ones, so they are seeded per sample too."""
    attributes = getattr(dataset, "__dict__", {})  # a list, a tuple or a dict has none
    found = {name: value for name, value in attributes.items() if isinstance(value, GENERATOR_TYPES)}
    return {
        name: g for name, g in found.items() if not isinstance(g, torch.Generator) or g.device.type == "cpu"
    }


def _seeder(g: Any) -> Callable[[int], None]:
    """The function that seeds one generator from a sample's (already mixed) seed."""
    if isinstance(g, np.random.Generator) and type(g.bit_generator) is np.random.PCG64:
        # numpy's default, set in place: 0.3 us against 9.7 us for a new PCG64(seed) and its SeedSequence
        return pcg64_seeder(g.bit_generator)
    if isinstance(g, np.random.Generator):
        return lambda seed: setattr(g.bit_generator, "state", type(g.bit_generator)(seed).state)
    if isinstance(g, np.random.RandomState):
        return lambda seed: g.seed(seed % 2**32)
    return g.manual_seed if isinstance(g, torch.Generator) else g.seed


def _generators(owned: dict[str, Any]) -> dict[str, Any]:
    """Every generator a sample's draws can come from, looked up in the process that fetches (a
    DataLoader worker has its own globals): python's, numpy's legacy one, torch's CPU one, and
    the dataset's own."""
    return {
        "random": random.random.__self__,
        "numpy": np.random.mtrand._rand,
        "torch": torch.default_generator,
    } | owned


def draws_nothing(dataset: Dataset) -> bool:
    """True for datasets whose ``__getitem__`` cannot draw a random number: torch's
    ``TensorDataset``, a list, tuple or dict (of samples), the ``Subset``/``ConcatDataset``/
    ``StackDataset`` of such, and a class that says so itself with ``draws_random = False``
    (ddpkit's own), exactly those classes: a subclass may add a random transform. They are
    fetched plainly, without the per-batch watch."""
    kind = type(dataset)
    if kind in (TensorDataset, list, tuple, dict) or vars(kind).get("draws_random", True) is False:
        return True
    if kind is Subset:
        return draws_nothing(dataset.dataset)
    if kind is ConcatDataset:
        return all(map(draws_nothing, dataset.datasets))
    if kind is StackDataset:
        parts = dataset.datasets
        return all(map(draws_nothing, parts.values() if isinstance(parts, dict) else parts))
    return False


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
    In the training process (num_workers=0) the generators are put back afterwards, so the
    model's own draws (dropout) are what they would be without data loading.

    Costs (2026-11-27, this 2-core CPU, ``ddpkit bench data``): per sample, hot, 0.3 us for a
    numpy Generator, 3.8 us for python's, 1.6 us for numpy's legacy one and 1.1 us for torch's,
    plus 0.5 us for the seed's mix; per batch, about 1 us a generator to take, compare and put
    back its state as raw bytes (``run/raw_state.py``).
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.owned = owned_generators(dataset)
        self.drawn: set[str] = set()  # the generators the dataset has been seen to draw from
        self.plain = draws_nothing(dataset)

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
        generators = _generators(self.owned)
        in_worker = get_worker_info() is not None  # a worker's generators are its own
        watched = {name: g for name, g in generators.items() if name not in self.drawn}
        # One snapshot each: the mark that tells whether it drew, and what is put back.
        saved = {name: snapshot(g) for name, g in generators.items() if name in watched or not in_worker}
        try:
            while True:
                batch = self._seeded(generators, indices) if self.drawn else self._plain(indices)
                moved = {name for name, g in watched.items() if snapshot(g) != saved[name]}
                if not moved:
                    return batch
                self.drawn |= moved  # fetched again, those seeded per sample too
                watched = {name: g for name, g in watched.items() if name not in moved}
        finally:
            if not in_worker:  # the training process's generators are the run's
                for name in self.drawn & saved.keys():
                    restore(generators[name], saved[name])

    def _plain(self, indices: list[int]) -> list:
        own = getattr(self.dataset, "__getitems__", None)
        return own(indices) if own else [self.dataset[i] for i in indices]

    def _seeded(self, generators: dict[str, Any], indices: list[int]) -> list:
        epoch, drawn, seed = getattr(indices, "epoch", 0), self.drawn, self.seed
        streams = [(n, _seeder(g)) for n, (name, g) in enumerate(generators.items()) if name in drawn]
        batch = []
        for index in indices:
            for number, seed_with in streams:  # each generator its own stream
                seed_with(sample_seed(seed, epoch, index, number))
            batch.append(self.dataset[index])
        return batch
