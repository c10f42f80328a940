"""A generator's state as raw bytes: taken, compared and put back in about a microsecond.

Seeding per sample (``run/seeding.py``) saves every generator a dataset might draw from before
each batch, compares it after and puts the run's back. Through the libraries' own accessors
that costs 33 us for numpy's legacy global (its ``get_state`` copies 624 words one by one in a
Python-level loop), 35 us to set it back and 8 us for python's ``random.getstate``: about 100 us
a batch, 3 us a sample at batches of 32. Read as bytes from the generators' own memory the same
states cost under 1 us each:

- numpy's Mersenne Twister and PCG64 bit generators, through the address numpy publishes
  (``bit_generator.ctypes.state_address``);
- numpy's ``RandomState`` also caches one gaussian, and python's ``random.Random`` keeps its
  624 words and position in its C struct: their places in the object are found once, at import,
  by setting known states through the official API and looking for them.

Each layout is checked at import against the official accessors; where a check fails (another
numpy, another Python), ``snapshot`` falls back to those accessors, slower but the same.
``pcg64_seeder`` sets a PCG64's state in place the same way (0.3 us against 2 us through its
``state`` property).
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

_MT_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos
_PY_BYTES = 4 + 624 * 4  # CPython's RandomObject: int index, uint32 state[624]


def _find(owner: object, needle: bytes) -> int | None:
    """The one offset of ``needle`` inside ``owner``'s C struct, or None."""
    size = type(owner).__basicsize__
    found = ctypes.string_at(id(owner), size).find(needle)
    return None if found < 0 else found


def _python_offset() -> int | None:
    """Where a ``random.Random``'s (index, state[624]) sit in its object, checked twice."""
    if sys.implementation.name != "cpython":
        return None
    probe = random.Random()
    words = tuple(range(1000, 1624))
    probe.setstate((3, words + (7,), None))
    place = _find(probe, struct.pack("<624I", *words))
    if place is None:
        return None
    place -= 4
    probe.seed(12345)
    version, state, _ = probe.getstate()
    expected = struct.pack("<i624I", state[-1], *state[:-1])
    return place if ctypes.string_at(id(probe) + place, _PY_BYTES) == expected else None


def _gauss_offset() -> int | None:
    """Where a numpy ``RandomState`` keeps (has_gauss, gauss), checked with a second value."""
    if sys.implementation.name != "cpython":
        return None
    probe = np.random.RandomState(0)
    key = probe.get_state()[1]
    probe.set_state(("MT19937", key, 624, 1, 0.123456789012345))
    place = _find(probe, struct.pack("<d", 0.123456789012345))
    if place is None or ctypes.string_at(id(probe) + place - 8, 4) != struct.pack("<i", 1):
        return None
    probe.set_state(("MT19937", key, 624, 0, -7.5))
    ok = ctypes.string_at(id(probe) + place - 8, 16)[:4] == struct.pack("<i", 0)
    return place - 8 if ok and ctypes.string_at(id(probe) + place, 8) == struct.pack("<d", -7.5) else None


def _pcg_order() -> str | None:
    """How a PCG64 keeps its 128-bit state and increment: "<" (native 128-bit integers, low word
    first) or ">" (numpy's emulated pair, high word first); None if neither matches."""
    bits = np.random.PCG64(0)
    state, inc = (1 << 64) | 2, (3 << 64) | 5
    bits.state = {
        "bit_generator": "PCG64",
        "state": {"state": state, "inc": inc},
        "has_uint32": 0,
        "uinteger": 0,
    }
    raw = ctypes.string_at(_pcg_address(bits), 32)
    for order, words in (("<", (2, 1, 5, 3)), (">", (1, 2, 3, 5))):
        if raw == struct.pack("<4Q", *words):
            return order
    return None


def pcg64_state(state: int, inc: int) -> dict:
    """A PCG64's ``state`` property's value for this state and increment, nothing cached."""
    return {"bit_generator": "PCG64", "state": {"state": state, "inc": inc}, "has_uint32": 0, "uinteger": 0}


def _pcg_address(bits: Any) -> int:
    """A PCG64's pcg64_random_t: the first field of the state numpy publishes is a pointer to it."""
    return ctypes.c_void_p.from_address(bits.ctypes.state_address).value


_PY, _GAUSS, _PCG = _python_offset(), _gauss_offset(), _pcg_order()
_MASK = 2**64 - 1


def pcg64_words(seed: int) -> tuple[int, int]:
    """A PCG64's (state, increment) for a seed already mixed by splitmix64: the seed xor three
    constants, one per 64-bit word; the increment must be odd."""
    state = seed ^ _K[0] | (seed ^ _K[1]) << 64
    return state, seed ^ _K[2] | 1 | (seed ^ _K[3]) << 64


_K = (0, 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def pcg64_seeder(bits: Any) -> Callable[[int], None]:
    """A function that seeds this PCG64 (``pcg64_words``) and clears its cached half-word: in
    place, through views made once (0.3 us a seed), where its layout is known here; otherwise
    through its ``state`` property (2 us)."""
    if _PCG is None:
        return lambda seed: setattr(bits, "state", pcg64_state(*pcg64_words(seed)))
    words = (ctypes.c_uint64 * 4).from_address(_pcg_address(bits))
    cached = ctypes.c_uint64.from_address(bits.ctypes.state_address + 8)  # has_uint32, uinteger
    order = (0, 1, 2, 3) if _PCG == "<" else (1, 0, 3, 2)  # low word first, or high first
    state_low, state_high, inc_low, inc_high = order

    def seed_with(seed: int) -> None:
        words[state_low], words[state_high] = seed ^ _K[0], seed ^ _K[1]
        words[inc_low], words[inc_high] = seed ^ _K[2] | 1, seed ^ _K[3]
        cached.value = 0

    return seed_with


def _bits(g: Any) -> Any:
    return g._bit_generator if isinstance(g, np.random.RandomState) else getattr(g, "bit_generator", None)


def snapshot(g: Any) -> Any:
    """The generator's whole state, as bytes where its layout is known: equal snapshots mean it
    did not draw, and ``restore`` puts a snapshot back."""
    bits = _bits(g)
    if isinstance(bits, np.random.MT19937):
        raw = ctypes.string_at(bits.ctypes.state_address, _MT_BYTES)
        if not isinstance(g, np.random.RandomState):
            return raw
        if _GAUSS is not None:
            return raw + ctypes.string_at(id(g) + _GAUSS, 16)
    elif type(bits) is np.random.PCG64 and _PCG is not None:
        return ctypes.string_at(_pcg_address(bits), 32) + ctypes.string_at(bits.ctypes.state_address + 8, 8)
    elif isinstance(g, random.Random) and _PY is not None:
        return ctypes.string_at(id(g) + _PY, _PY_BYTES), g.gauss_next
    elif isinstance(g, torch.Generator):
        return g.get_state().numpy().tobytes()
    return _Slow(g)


def restore(g: Any, snap: Any) -> None:
    """Put back what ``snapshot`` took."""
    if isinstance(snap, _Slow):
        snap.put_back(g)
    elif isinstance(g, torch.Generator):
        g.set_state(torch.frombuffer(bytearray(snap), dtype=torch.uint8))
    elif isinstance(g, random.Random):
        ctypes.memmove(id(g) + _PY, snap[0], _PY_BYTES)
        g.gauss_next = snap[1]
    elif type(_bits(g)) is np.random.PCG64:
        bits = _bits(g)
        ctypes.memmove(_pcg_address(bits), snap[:32], 32)
        ctypes.memmove(bits.ctypes.state_address + 8, snap[32:], 8)
    else:  # a Mersenne Twister, with RandomState's cached gaussian
        ctypes.memmove(_bits(g).ctypes.state_address, snap[:_MT_BYTES], _MT_BYTES)
        if isinstance(g, np.random.RandomState):
            ctypes.memmove(id(g) + _GAUSS, snap[_MT_BYTES:], 16)


class _Slow:
    """A state through the library's own accessor, where its bytes' layout is not known here."""

    def __init__(self, g: Any) -> None:
        self.state = g.bit_generator.state if isinstance(g, np.random.Generator) else _get(g)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Slow) and _same(self.state, other.state)

    def put_back(self, g: Any) -> None:
        if isinstance(g, np.random.Generator):
            g.bit_generator.state = self.state
        else:
            g.setstate(self.state) if isinstance(g, random.Random) else g.set_state(self.state)


def _get(g: Any) -> Any:
    return g.getstate() if isinstance(g, random.Random) else g.get_state()


def _same(a: Any, b: Any) -> bool:
    """Equal generator states, compared whole (a repr would elide the middle of a long state)."""
    if isinstance(a, tuple) and len(a) == 5:  # numpy's legacy: (name, key array, pos, has_gauss, gauss)
        return a[2:] == b[2:] and a[0] == b[0] and np.array_equal(a[1], b[1])
    if isinstance(a, dict):  # numpy's bit generators': numbers, and arrays for MT19937 and Philox
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b  # python's: a tuple of ints
