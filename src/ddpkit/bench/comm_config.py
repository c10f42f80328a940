"""What ``ddpkit bench comm`` is asked to do: sizes in nccl-tests' notation, operations, dtype, timing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ddpkit.bench.collectives import COLLECTIVES, REDOPS
from ddpkit.errors import ConfigError

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
AVERAGES = ("mean", "max", "min", "rank0")
DEFAULT_SIZES = "1K:4M"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str, flag: str = "--sizes") -> int:
    """``1K`` -> 1024, ``64M`` -> 67108864 (binary units, as nccl-tests reads -b and -e)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text, flags=re.IGNORECASE)
    if match is None or int(match.group(1)) < 1:
        raise ConfigError(
            f"{flag}: {text!r} is not a size; use a positive number of bytes with an optional "
            "K, M or G, for example --sizes 1K:64M"
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(text: str) -> tuple[int, ...]:
    """``MIN:MAX[:FACTOR]`` -> MIN, MIN*FACTOR, ... up to MAX (FACTOR 2 by default), or one ``SIZE``."""
    parts = text.split(":")
    if len(parts) > 3:
        raise ConfigError(f"--sizes {text!r} has too many parts; use MIN:MAX[:FACTOR], for example 1K:64M")
    low = parse_size(parts[0])
    high = parse_size(parts[1]) if len(parts) > 1 else low
    factor = _parse_factor(parts[2]) if len(parts) > 2 else 2
    if low > high:
        raise ConfigError(f"--sizes {text!r} starts above its end; put the smaller size first, e.g. 1K:64M")
    sizes = [low]
    while sizes[-1] * factor <= high:
        sizes.append(sizes[-1] * factor)
    return tuple(sizes)


def _parse_factor(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 2:
        raise ConfigError(
            f"--sizes factor {text!r} must be a whole number of at least 2; e.g. --sizes 1K:64M:4"
        )
    return int(text)


def parse_names(text: str, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """``a,b`` -> ("a", "b"), or every known name for ``all``; an unknown name is a ConfigError."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if text.strip() == "all":
        return known
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ConfigError(
            f"{flag} {text!r}: unknown {bad or 'empty list'}; choose from all, {', '.join(known)}"
        )
    return names


@dataclass(frozen=True)
class CommConfig:
    """What ``ddpkit bench comm`` measures and how.

    Args:
        ops: operations to run, in table order; names from ``COLLECTIVES``.
        redops: reduce ops for the operations that take one: ``sum``, ``prod``, ``max``, ``min``.
        sizes: message sizes in bytes (nccl-tests' size column).
        dtype: element type: float32, float64, float16, bfloat16, int8, uint8, int32 or int64.
        iters: timed iterations per row.
        warmup: untimed iterations before them (connection set-up, caches, allocator).
        average: how the ranks' mean times combine into a row's time: mean, max, min or rank0.
        backend: process-group backend: auto, gloo, nccl or mpi.
    """

    ops: tuple[str, ...] = tuple(COLLECTIVES)
    redops: tuple[str, ...] = tuple(REDOPS)
    sizes: tuple[int, ...] = field(default_factory=lambda: parse_sizes(DEFAULT_SIZES))
    dtype: str = "float32"
    iters: int = 20
    warmup: int = 5
    average: str = "mean"
    backend: str = "auto"

    def __post_init__(self) -> None:
        parse_names(",".join(self.ops), tuple(COLLECTIVES), "--ops")
        parse_names(",".join(self.redops), tuple(REDOPS), "--redops")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.iters < 1:
            raise ConfigError(f"--iters {self.iters} is below 1; time at least one, e.g. --iters 20")
        if self.warmup < 0:
            raise ConfigError(f"--warmup {self.warmup} is negative; use 0 or more, e.g. --warmup 5")
        if self.average not in AVERAGES:
            raise ConfigError(f"--average {self.average!r} is unknown; choose one of {', '.join(AVERAGES)}")
        if not self.sizes or min(self.sizes) < 1:
            raise ConfigError(f"sizes {self.sizes} must be positive byte counts; e.g. --sizes 1K:1M")
