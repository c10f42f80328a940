"""Random numbers keyed by the sample they are drawn for: the same draws at any world size.

A single-device model's dropout, or a diffusion loop's noise, draws from the generator of
whichever process holds the sample, at its place in that process's stream. Under data
parallelism which process and which micro-batch hold a sample depend on the world size, so the
draws do too (nn.Dropout(0.2) puts 1 and 2 processes 4.6e-2 apart). Here every number is a
hash of (run seed, step, the sample's position in the global batch, the stream it belongs to,
its position within the sample) instead: a counter-based generator in the manner of Philox,
with no state to carry, on the device, in a handful of integer elementwise ops (``torch.compile``
fuses them into one kernel).

The hash is "lowbias32" (Chris Wellons' hash-prospector, bias about 0.17) on int32 tensors:
torch's int32 multiply wraps modulo 2**32 and its right shift is arithmetic, so every shift is
masked to act as a logical one. ``tests/run/test_keyed_random.py`` holds the torch version to
the same hash computed in exact Python integers, and its statistics to a uniform stream's.
"""

from __future__ import annotations

import hashlib
import math

import torch

GOLDEN = 0x9E3779B9 - 2**32  # 2**32 / phi, as int32: spreads consecutive counters apart
_M1, _M2 = 0x7FEB352D, 0x846CA68B - 2**32


def mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of every element of an int32 tensor, in place (``x`` is returned).

    In place, with one scratch tensor: eager, each op is a pass over memory, and fresh
    temporaries made the keyed dropout layer slower than nn.Dropout on the CPU (docs/engine.md)."""
    t = x >> 16
    x ^= t.bitwise_and_(0xFFFF)
    x *= _M1
    x ^= torch.bitwise_right_shift(x, 15, out=t).bitwise_and_(0x1FFFF)
    x *= _M2
    x ^= torch.bitwise_right_shift(x, 16, out=t).bitwise_and_(0xFFFF)
    return x


def mix_int(x: int) -> int:
    """The same hash on one Python integer (0 <= x < 2**32): the reference the tests hold ``mix`` to."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def salt(*parts: object) -> int:
    """A 32-bit signed constant from anything printable (a module's name, a stream's number)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little", signed=True)


def row_keys(seed: int, step: int, offset: int, rows: int, device: torch.device) -> torch.Tensor:
    """(rows,) int32: one key per sample of a micro-batch, from (seed, step, its place in the
    global batch). Built where the loop runs, outside any compiled region: the step is a tensor's
    value there, never a constant a compiled graph would be specialised on."""
    places = torch.arange(offset, offset + rows, dtype=torch.int32, device=device)
    return mix(mix(places * GOLDEN ^ salt(seed, step)))


class Positions:
    """``arange(n) * GOLDEN`` per (n, device), made once: each element's counter within its sample."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, device)
        if key not in self._cache:
            self._cache[key] = torch.arange(n, dtype=torch.int32, device=device) * GOLDEN
        return self._cache[key]


def bits(rows: torch.Tensor, per_row: int, stream: int, positions: Positions) -> torch.Tensor:
    """(len(rows), per_row) int32 hash bits: row r's element j from (rows[r], stream, j)."""
    counters = (rows ^ stream).unsqueeze(1) + positions(per_row, rows.device).unsqueeze(0)
    return mix(counters)


def uniform(hashed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Floats in [0, 1) from hash bits, with 24 random bits each (float32's mantissa)."""
    return ((hashed >> 8) & 0xFFFFFF).to(dtype) * (1.0 / 2**24)


def keep_mask(hashed: torch.Tensor, p: float) -> torch.Tensor:
    """True where an element survives dropout with probability ``1 - p`` (an integer compare);
    ``hashed`` is used up."""
    return hashed.bitwise_and_(0x7FFFFFFF) >= round(p * 2**31)


def normal(first: torch.Tensor, second: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal numbers by Box-Muller from two independent sets of hash bits."""
    u1 = (((first >> 8) & 0xFFFFFF).to(torch.float32) + 1.0) * (1.0 / 2**24)  # (0, 1]: log is finite
    u2 = uniform(second)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)).to(dtype)
