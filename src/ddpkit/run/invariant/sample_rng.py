"""``ddpkit.sample_rng()``: the generators of the sample being fetched, seeded from (run seed,
epoch, sample index) alone.

A dataset that draws its augmentation from them, instead of from the global generators, draws
the same for a sample at any world size, micro-batch or worker count, and after a resume; and,
if its class says so (``draws_random = "sample_rng"``), run.loader neither watches, saves nor
puts back any other generator for it (``run/invariant/seeding.py``). Each generator is seeded on its first
use in a sample only, so a sample that draws from numpy alone pays for numpy's seed alone.

The sample being fetched is found through a ``ContextVar``: ``__getitem__`` takes no extra
argument, and a thread-based loader's threads each see their own sample.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch

from ddpkit.errors import ConfigError

_MASK = 2**64 - 1


def sample_seed(seed: int, epoch: int, index: int, stream: int = 0) -> int:
    """The seed of one sample's draws from one generator (``stream``): (run seed, epoch, sample
    index, generator) alone, mixed by splitmix64's finalizer (half of blake2b's time: docs/engine.md)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB + stream) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


_K = (0, 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def pcg64_seeder(bits: np.random.PCG64 | np.random.PCG64DXSM) -> Callable[[int], None]:
    """A function that seeds this PCG64 (or PCG64DXSM) from a seed already mixed by splitmix64:
    the seed xor one constant per 64-bit word, the increment odd, no cached half-word, set
    through the public ``state`` property (a fifth of ``PCG64(seed)`` and its SeedSequence:
    docs/engine.md). One dict, refilled each time, saves building one per sample."""
    words = {"state": 0, "inc": 1}
    state = {"bit_generator": type(bits).__name__, "state": words, "has_uint32": 0, "uinteger": 0}

    def seed_with(seed: int) -> None:
        words["state"] = seed ^ _K[0] | (seed ^ _K[1]) << 64
        words["inc"] = seed ^ _K[2] | 1 | (seed ^ _K[3]) << 64
        bits.state = state

    return seed_with


# Streams of sample_seed apart from those SeededFetch gives the generators it seeds (0, 1, 2, ...).
_NUMPY, _TORCH, _PYTHON = 2**32, 2**32 + 1, 2**32 + 2


class SampleRng:
    """The current sample's generators: ``numpy`` (a ``np.random.Generator``), ``torch`` (a CPU
    ``torch.Generator``) and ``python`` (a ``random.Random``), each seeded from (run seed, epoch,
    sample index) on its first use in the sample. Valid only while that sample is fetched."""

    def __init__(self, seed: int, epoch: int) -> None:
        self._seed, self._epoch = seed, epoch
        self._index: int | None = None  # the sample being fetched; None between samples
        self._numpy = self._torch = self._python = None
        self._serial = 0  # counts samples: an index fetched twice in a row is seeded twice
        self._seeded: dict[int, int] = {}  # stream -> the serial it was last seeded for

    def _start(self, index: int | None) -> None:
        self._index, self._serial = index, self._serial + 1

    def _fresh(self, stream: int) -> int | None:
        """The stream's seed if it has not been seeded for this sample yet, else None."""
        if self._index is None:
            raise ConfigError(_OUTSIDE)
        if self._seeded.get(stream) == self._serial:
            return None
        self._seeded[stream] = self._serial
        return sample_seed(self._seed, self._epoch, self._index, stream)

    @property
    def numpy(self) -> np.random.Generator:
        seed = self._fresh(_NUMPY)
        if self._numpy is None:
            self._numpy = np.random.Generator(np.random.PCG64(0))
            self._seed_numpy = pcg64_seeder(self._numpy.bit_generator)
        if seed is not None:
            self._seed_numpy(seed)
        return self._numpy

    @property
    def torch(self) -> torch.Generator:
        seed = self._fresh(_TORCH)
        if self._torch is None:
            self._torch = torch.Generator()
        if seed is not None:
            self._torch.manual_seed(seed)
        return self._torch

    @property
    def python(self) -> random.Random:
        seed = self._fresh(_PYTHON)
        if self._python is None:
            self._python = random.Random(0)
        if seed is not None:
            self._python.seed(seed)
        return self._python


_OUTSIDE = (
    "ddpkit.sample_rng() is for a Dataset's __getitem__ while run.loader or run.evaluate fetches "
    "the sample; elsewhere draw from a generator of your own"
)
_CURRENT: ContextVar[SampleRng | None] = ContextVar("ddpkit_sample_rng", default=None)


def sample_rng() -> SampleRng:
    """The generators of the sample being fetched, seeded from (run seed, epoch, sample index):
    the same draws for the sample at any world size, micro-batch or worker count, and after a
    resume.

    Call it inside a Dataset's ``__getitem__`` under ``run.loader`` (or ``run.evaluate``):
    ``rng = ddpkit.sample_rng(); top, left = rng.numpy.integers(0, 9, 2)``; ``rng.torch`` is a
    CPU ``torch.Generator`` (``torch.rand(3, generator=rng.torch)``), ``rng.python`` a
    ``random.Random``. A class that draws from nothing else says so with
    ``draws_random = "sample_rng"``: then no other generator is watched, saved or seeded for it.

    Raises:
        ConfigError: outside a sample's fetch.
    """
    rng = _CURRENT.get()
    if rng is None or rng._index is None:
        raise ConfigError(_OUTSIDE)
    return rng


@contextmanager
def fetching(seed: int, epoch: int) -> Iterator[Callable[[int | None], None]]:
    """``with fetching(seed, epoch) as start:`` makes ``sample_rng()`` valid for the batch; call
    ``start(index)`` before each sample (``start(None)`` after it)."""
    rng = SampleRng(seed, epoch)
    token = _CURRENT.set(rng)
    try:
        yield rng._start
    finally:
        rng._index = None
        _CURRENT.reset(token)
