"""The run's own settings, and the routing of ``ddpkit.Run``'s keyword options to each component's config."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ddpkit.dist.init import BACKENDS
from ddpkit.errors import ConfigError
from ddpkit.run.engine import EngineConfig
from ddpkit.run.loader import DataConfig
from ddpkit.run.monitor import DiagnosticsConfig
from ddpkit.run.optim import OptimConfig
from ddpkit.run.state import CheckpointConfig


@dataclass(frozen=True)
class RunConfig:
    """Which run this is: where it writes, how it is seeded, how far it goes.

    Args:
        out: folder for checkpoints, metrics.jsonl, loss.png, model.pt and hang reports; None
            writes nothing (and allows no checkpoints).
        seed: seeds every generator, the same on every rank, and the data order.
        backend: ``auto`` (nccl with a GPU per process, else gloo), ``gloo``, ``nccl`` or ``mpi``.
        steps: stop after this many optimizer steps; None runs the epochs the loop asks for.
    """

    out: str | None = None
    seed: int = 0
    backend: str = "auto"
    steps: int | None = None

    def __post_init__(self) -> None:
        if self.out is not None and not str(self.out).strip():
            raise ConfigError("out='' names no folder; give one such as 'runs/mine', or None for no files")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be a non-negative integer")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.steps is not None and (isinstance(self.steps, bool) or self.steps < 1):
            raise ConfigError(f"steps={self.steps} is below 1; use a positive number, or None for epochs")


COMPONENTS = (DataConfig, EngineConfig, CheckpointConfig, OptimConfig, DiagnosticsConfig)


def split_options(options: dict[str, Any]) -> tuple:
    """One config per component, in ``COMPONENTS`` order; an unknown option is an error naming it."""
    owners = {f.name: cls for cls in COMPONENTS for f in fields(cls)}
    unknown = sorted(set(options) - set(owners))
    if unknown:
        raise ConfigError(f"ddpkit.Run got unknown options {unknown}; known ones are {sorted(owners)}")
    return tuple(cls(**{k: v for k, v in options.items() if owners[k] is cls}) for cls in COMPONENTS)
