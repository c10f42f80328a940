"""Generator states read and written as raw bytes (run/raw_state.py) agree with the libraries'
own accessors: what a snapshot puts back draws the same numbers, and a moved generator is seen."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ddpkit.run import raw_state


def _draw(g):
    if isinstance(g, random.Random):
        return [g.random(), g.gauss(0, 1)]
    if isinstance(g, np.random.RandomState):
        return [g.randn(), g.rand()]
    if isinstance(g, torch.Generator):
        return torch.rand(3, generator=g).tolist()
    return [g.random(), g.standard_normal(), int(g.integers(0, 2**31, dtype=np.uint32))]


GENERATORS = {
    "python": lambda: random.Random(5),
    "numpy legacy": lambda: np.random.RandomState(9),
    "numpy pcg64": lambda: np.random.default_rng(3),
    "numpy mt19937": lambda: np.random.Generator(np.random.MT19937(1)),
    "numpy philox": lambda: np.random.Generator(np.random.Philox(2)),
    "torch": lambda: torch.Generator().manual_seed(4),
}


@pytest.mark.parametrize("kind", GENERATORS)
def test_a_snapshot_puts_back_what_the_accessors_would(kind):
    g = GENERATORS[kind]()
    _draw(g)  # a cached gaussian or half-word in the state, where the generator keeps one
    snap = raw_state.snapshot(g)
    first = _draw(g)
    assert raw_state.snapshot(g) != snap
    raw_state.restore(g, snap)
    assert raw_state.snapshot(g) == snap
    assert _draw(g) == first


def test_a_cached_gaussian_alone_is_a_move():
    g = np.random.RandomState(1)
    g.randn()  # two made, one cached: the next draw moves nothing but the cache
    snap = raw_state.snapshot(g)
    g.randn()
    assert raw_state.snapshot(g) != snap


def test_the_in_place_pcg64_seed_is_the_state_the_property_would_set():
    g = np.random.default_rng(0)
    g.integers(0, 10, dtype=np.uint32)  # leaves a cached half-word, which the seed must clear
    seed = 0x1234_5678_9ABC_DEF0
    raw_state.pcg64_seeder(g.bit_generator)(seed)
    assert g.bit_generator.state == raw_state.pcg64_state(*raw_state.pcg64_words(seed))
    assert raw_state.pcg64_words(seed)[1] % 2 == 1
