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
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, StackDataset, Subset, TensorDataset, get_worker_info

from ddpkit.errors import ConfigError
from ddpkit.run.invariant.sample_rng import fetching, pcg64_seeder, sample_seed


def seed_everything(seed: int) -> None:
    """The same seed on every rank: identical model init, so the engine's broadcast changes nothing."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
    """The function that seeds one generator from a sample's (already mixed) seed, through the
    library's public setter."""
    bits = getattr(g, "bit_generator", None)
    if isinstance(g, np.random.Generator) and type(bits) in (np.random.PCG64, np.random.PCG64DXSM):
        return pcg64_seeder(bits)  # numpy's default, without a SeedSequence
    if isinstance(g, np.random.Generator):
        return lambda seed: setattr(bits, "state", type(bits)(seed).state)
    if isinstance(g, np.random.RandomState | _NumpyGlobal):
        return lambda seed: g.seed(seed % 2**32)
    return g.manual_seed if isinstance(g, torch.Generator) else g.seed


class _NumpyGlobal:
    """numpy's legacy global generator through its public module functions (the object behind
    them, ``np.random.mtrand._rand``, is private)."""

    def seed(self, seed: int) -> None:
        np.random.seed(seed)

    def get_state(self, legacy: bool) -> Any:
        return np.random.get_state(legacy=legacy)

    def set_state(self, state: Any) -> None:
        np.random.set_state(state)


def _generators(owned: dict[str, Any]) -> dict[str, Any]:
    """Every generator a sample's draws can come from, looked up in the process that fetches (a
    DataLoader worker has its own globals): python's, numpy's legacy one, torch's CPU one, and
    the dataset's own."""
    python, numpy = random.random.__self__, _NumpyGlobal()
    return {"random": python, "numpy": numpy, "torch": torch.default_generator} | owned


def _state(g: Any) -> Any:
    """A generator's whole state through its library's accessor: equal states (``_same``) mean it
    did not draw, and ``_put_back`` sets it again."""
    if isinstance(g, torch.Generator):
        return g.get_state().numpy().tobytes()  # bytes compare whole, in one memcmp
    if isinstance(g, random.Random):
        return g.getstate()
    if isinstance(g, np.random.RandomState | _NumpyGlobal):
        return g.get_state(legacy=False)  # with its cached gaussian
    return g.bit_generator.state


def _put_back(g: Any, state: Any) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    elif isinstance(g, random.Random):
        g.setstate(state)
    elif isinstance(g, np.random.RandomState | _NumpyGlobal):
        g.set_state(state)
    else:
        g.bit_generator.state = state


def _same(a: Any, b: Any) -> bool:
    """Equal generator states, compared whole (a repr would elide the middle of a long state)."""
    if isinstance(a, dict):  # numpy's: numbers, and arrays for MT19937's key and Philox's
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b  # python's tuple of ints, torch's bytes


class _Kept:
    """One generator over one batch: its state read once, ``moved()`` after each fetch (did the
    dataset draw from it?), ``put_back()`` after the batch."""

    changes = False  # True where watching changes the generator, so that it must be put back

    def __init__(self, g: Any, watched: bool, in_worker: bool, twins: _Twins) -> None:
        self.g, self.state = g, _state(g)

    def arm(self) -> None:
        """Called before each fetch that watches the generator."""

    def moved(self) -> bool:
        return not _same(_state(self.g), self.state)

    def put_back(self) -> None:
        _put_back(self.g, self.state)


_KNOWN = random.Random(0x5EED).getstate()
_KNOWN_FIRST = random.Random(0x5EED).getrandbits(64)


class _KeptPython(_Kept):
    """A ``random.Random``, watched from a known state: one draw after the fetch tells whether the
    dataset drew (0.1 us, against 8 us to read its 625 words again and 5 us to compare them)."""

    changes = True

    def arm(self) -> None:
        self.g.setstate(_KNOWN)

    def moved(self) -> bool:
        return self.g.getrandbits(64) != _KNOWN_FIRST


class _KeptNumpy(_Kept):
    """numpy's legacy global generator, its bit generator swapped for the batch
    (``np.random.set_bit_generator``): the run's own is left untouched instead of read (31 us)
    and written back (33 us) whole. Swapping clears the global's cached gaussian, so the training
    process reads the state once, for that, and sets it back where there was one."""

    changes = True

    def __init__(self, g: Any, watched: bool, in_worker: bool, twins: _Twins) -> None:
        self.g, self.original, self.twins = g, np.random.get_bit_generator(), twins
        self.state = None if in_worker else np.random.get_state(legacy=False)
        np.random.set_bit_generator(twins.lend(watched))

    def moved(self) -> bool:
        return self.twins.moved()

    def put_back(self) -> None:
        np.random.set_bit_generator(self.original)
        if self.state is not None and self.state["has_gauss"]:
            np.random.set_state(self.state)


class _Twins:
    """Two Mersenne Twisters in step: one is numpy's global while a watched batch is fetched, the
    other is never lent; a draw from each after the fetch tells whether the dataset drew (0.6 us).
    Where numpy's global is seeded per sample, a third stands in (``watched=False``)."""

    def __init__(self) -> None:
        self.pair: tuple[Any, Any] | None = None
        self.scratch = np.random.MT19937(0)

    def lend(self, watched: bool) -> Any:
        if not watched:
            return self.scratch
        if self.pair is None:
            self.pair = (np.random.MT19937(0x5EED), np.random.MT19937(0x5EED))
        return self.pair[0]

    def moved(self) -> bool:
        lent, kept = self.pair
        moved = (lent.random_raw(), lent.random_raw()) != (kept.random_raw(), kept.random_raw())
        if moved:  # the lent one is the dataset's now, seeded per sample
            self.pair = None
        return moved


# The global generators are the process's: batches fetched by threads (a loader of the user's)
# take turns to seed, swap and put them back, or one would put back another's stand-in.
_PROCESS_GENERATORS = threading.RLock()


def _keeper(g: Any) -> type[_Kept]:
    if isinstance(g, _NumpyGlobal) and hasattr(np.random, "set_bit_generator"):  # numpy >= 1.25
        return _KeptNumpy
    return _KeptPython if isinstance(g, random.Random) else _Kept


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
        self.twins = _Twins()  # numpy's global's stand-in while a batch is watched

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
        with _PROCESS_GENERATORS:
            return self._watched_alone(indices, start)

    def _watched_alone(self, indices: list[int], start: Callable[[int | None], None]) -> list:
        generators = _generators(self.owned)
        in_worker = get_worker_info() is not None  # a worker's generators are its own
        watched = {name for name in generators if name not in self.drawn}
        # Read once a batch: the mark that tells whether a generator drew, and what is put back.
        kept = {
            name: _keeper(g)(g, name in watched, in_worker, self.twins)
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
            for name, keeper in kept.items():
                if keeper.changes or name in self.drawn and not in_worker:
                    keeper.put_back()

    def _seeders(self, generators: dict[str, Any]) -> list[tuple[int, Callable[[int], None]]]:
        """(stream, seeder) of each generator seen drawn: each its own stream of sample_seed."""
        return [(n, _seeder(g)) for n, (name, g) in enumerate(generators.items()) if name in self.drawn]

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
