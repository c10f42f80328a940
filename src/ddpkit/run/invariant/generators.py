"""The generators a sample's draws can come from, and how a batch keeps them (run/invariant/seeding.py).

A dataset's ``__getitem__`` draws from python's, numpy's legacy and torch's CPU global generators,
or from generators it holds as attributes. For each: how to seed it from one sample's seed, how
to read and put back its state through the library's public accessors, and how to tell whether
a batch drew from it (python's probed from a known state; numpy's legacy global through a
stand-in bit generator and a twin). In a worker the globals are the worker's own and are seeded
without being put back; in the training process they are read once a batch and put back after it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit.run.invariant.sample_rng import pcg64_seeder

GENERATOR_TYPES = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)


def owned_generators(dataset: Dataset) -> dict[str, Any]:
    """The generators a dataset holds as attributes (``self.rng = np.random.default_rng()``): its
    draws come from them, not from the global ones, so they are seeded per sample too."""
    attributes = getattr(dataset, "__dict__", {})  # a list, a tuple or a dict has none
    found = {name: value for name, value in attributes.items() if isinstance(value, GENERATOR_TYPES)}
    return {
        name: g for name, g in found.items() if not isinstance(g, torch.Generator) or g.device.type == "cpu"
    }


def seeder(g: Any) -> Callable[[int], None]:
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


def process_generators(owned: dict[str, Any]) -> dict[str, Any]:
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

    def __init__(self, g: Any, watched: bool, in_worker: bool, twins: Twins) -> None:
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
    dataset drew, far cheaper than reading its 625 words again and comparing them (docs/engine.md)."""

    changes = True

    def arm(self) -> None:
        self.g.setstate(_KNOWN)

    def moved(self) -> bool:
        return self.g.getrandbits(64) != _KNOWN_FIRST


class _KeptNumpy(_Kept):
    """numpy's legacy global generator, its bit generator swapped for the batch
    (``np.random.set_bit_generator``): the run's own is left untouched instead of read and
    written back whole, the slowest of the public accessors (docs/engine.md). Swapping clears
    the global's cached gaussian, so the training process reads the state once, for that, and
    sets it back where there was one."""

    changes = True

    def __init__(self, g: Any, watched: bool, in_worker: bool, twins: Twins) -> None:
        self.g, self.original, self.twins = g, np.random.get_bit_generator(), twins
        self.state = None if in_worker else np.random.get_state(legacy=False)
        np.random.set_bit_generator(twins.lend(watched))

    def moved(self) -> bool:
        return self.twins.moved()

    def put_back(self) -> None:
        np.random.set_bit_generator(self.original)
        if self.state is not None and self.state["has_gauss"]:
            np.random.set_state(self.state)


class Twins:
    """Two Mersenne Twisters in step: one is numpy's global while a watched batch is fetched, the
    other is never lent; a draw from each after the fetch tells whether the dataset drew.
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
PROCESS_LOCK = threading.RLock()


def keeper(g: Any) -> type[_Kept]:
    if isinstance(g, _NumpyGlobal) and hasattr(np.random, "set_bit_generator"):  # numpy >= 1.25
        return _KeptNumpy
    return _KeptPython if isinstance(g, random.Random) else _Kept
