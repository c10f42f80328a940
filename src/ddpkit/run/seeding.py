"""Random transforms in a dataset, seeded per sample: the same draws at any world size.

A single-device script's augmentation (a random flip in ``__getitem__``) draws from the global
generators of whichever process fetches the sample. Under data parallelism that process, its
position in its stream and the other samples of its batch all depend on the world size and the
micro-batch, so the draws would too. ``SeededFetch`` seeds each generator the dataset draws from
(python's, numpy's, torch's CPU one, its own) from (run seed, epoch, sample index) before each
sample instead.
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, StackDataset, Subset, TensorDataset, get_worker_info


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


_PCG_MULT, _PCG_INC = 0x9E3779B97F4A7C15F39CC0605CEDC835, 0xDA942042E4DD58B5C4C2F5D8E9D6A3B1  # odd 128-bit

GENERATOR_TYPES = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)


def owned_generators(dataset: Dataset) -> dict[str, Any]:
    """The generators a dataset holds as attributes (``self.rng = np.random.default_rng()``): its
    draws come from them, not from the global ones, so they are seeded per sample too."""
    found = {name: value for name, value in vars(dataset).items() if isinstance(value, GENERATOR_TYPES)}
    return {
        name: g for name, g in found.items() if not isinstance(g, torch.Generator) or g.device.type == "cpu"
    }


def _get_state(g: Any) -> Any:
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    return g.getstate() if isinstance(g, random.Random) else g.get_state()


def _mt_bytes(g: Any) -> bytes | None:
    """For numpy's Mersenne Twister (its legacy global among them), the raw bytes of its key and
    position, which tell whether it drew in 0.4 us against 30 us for its state; None for others."""
    bits = g._bit_generator if isinstance(g, np.random.RandomState) else getattr(g, "bit_generator", None)
    if isinstance(bits, np.random.MT19937):
        return ctypes.string_at(bits.ctypes.state_address, _MT_BYTES)
    return None


def _mark(g: Any) -> Any:
    """What tells whether a generator drew: its state, or its raw bytes where those are cheaper."""
    raw = _mt_bytes(g)
    return _get_state(g) if raw is None else raw


_MT_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos


def _set_state(g: Any, state: Any) -> None:
    if isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    elif isinstance(g, random.Random):
        g.setstate(state)
    else:
        g.set_state(state)


def _seed(g: Any, seed: int) -> None:
    if isinstance(g, np.random.Generator) and isinstance(g.bit_generator, np.random.PCG64):
        # numpy's default: its state set in place from the (already hashed) seed, 1.8 us against
        # 9.7 us for a new PCG64(seed) and its SeedSequence; the increment must be odd.
        state = {"state": seed * _PCG_MULT % 2**128, "inc": seed * _PCG_INC % 2**128 | 1}
        g.bit_generator.state = {"bit_generator": "PCG64", "state": state, "has_uint32": 0, "uinteger": 0}
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = type(g.bit_generator)(seed).state
    elif isinstance(g, np.random.RandomState):
        g.seed(seed % 2**32)
    elif isinstance(g, torch.Generator):
        g.manual_seed(seed)
    else:
        g.seed(seed)


def _generators(owned: dict[str, Any]) -> dict[str, Any]:
    """Every generator a sample's draws can come from, looked up in the process that fetches (a
    DataLoader worker has its own globals): python's, numpy's legacy one, torch's CPU one, and
    the dataset's own."""
    return {
        "random": random.random.__self__,
        "numpy": np.random.mtrand._rand,
        "torch": torch.default_generator,
    } | owned


def _same(a: Any, b: Any) -> bool:
    """Equal generator states, compared whole (a repr would elide the middle of a long state)."""
    if isinstance(a, torch.Tensor):  # torch's
        return torch.equal(a, b)
    if isinstance(a, tuple) and len(a) == 5:  # numpy's legacy: (name, key array, pos, has_gauss, gauss)
        return a[2:] == b[2:] and a[0] == b[0] and np.array_equal(a[1], b[1])
    if isinstance(a, dict):  # numpy's bit generators': numbers, and arrays for MT19937 and Philox
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b  # python's: a tuple of ints


def draws_nothing(dataset: Dataset) -> bool:
    """True for datasets whose ``__getitem__`` cannot draw a random number: torch's
    ``TensorDataset`` and the ``Subset``/``ConcatDataset``/``StackDataset`` of such, and a class
    that says so itself with ``draws_random = False`` (ddpkit's own), exactly those classes: a
    subclass may add a random transform. They are fetched plainly, without the per-batch watch
    (about 50 us a batch in the training process)."""
    kind = type(dataset)
    if kind is TensorDataset or vars(kind).get("draws_random", True) is False:
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

    Costs (2026-11-27, this 2-core CPU, ``ddpkit bench data``): per sample, about 2.5 us for a
    numpy Generator, 4.3 us for python's, 2 us for numpy's legacy one and 1.5 us for torch's;
    per batch, about 50 us to save and compare the states in the training process (numpy's
    legacy state alone is 30 us to read) and 15 us in a DataLoader worker, which restores nothing.
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

    def __getitems__(self, indices: list[int]) -> list:
        if self.plain:
            return self._plain(indices)
        generators = _generators(self.owned)
        in_worker = get_worker_info() is not None  # a worker's generators are its own
        watched = {name: g for name, g in generators.items() if name not in self.drawn}
        saved = {} if in_worker else {name: _get_state(g) for name, g in generators.items()}
        # A state saved to be put back is also the mark to compare, except numpy's Mersenne Twister's.
        marks = {name: saved[name] if name in saved else _mark(g) for name, g in watched.items()}
        marks |= {name: raw for name, g in watched.items() if (raw := _mt_bytes(g)) is not None}
        try:
            while True:
                batch = self._seeded(generators, indices) if self.drawn else self._plain(indices)
                moved = {name for name, g in watched.items() if not _same(marks[name], _mark(g))}
                if not moved:
                    return batch
                self.drawn |= moved  # fetched again, those seeded per sample too
                watched = {name: g for name, g in watched.items() if name not in moved}
        finally:
            if not in_worker:  # the training process's generators are the run's
                for name in self.drawn & saved.keys():
                    _set_state(generators[name], saved[name])

    def _plain(self, indices: list[int]) -> list:
        own = getattr(self.dataset, "__getitems__", None)
        return own(indices) if own else [self.dataset[i] for i in indices]

    def _seeded(self, generators: dict[str, Any], indices: list[int]) -> list:
        epoch, drawn, seed = getattr(indices, "epoch", 0), self.drawn, self.seed
        streams = [(number, g) for number, (name, g) in enumerate(generators.items()) if name in drawn]
        batch = []
        for index in indices:
            for number, g in streams:  # each generator its own stream
                _seed(g, sample_seed(seed, epoch, index, number))
            batch.append(self.dataset[index])
        return batch
