"""Route ``ddpkit.Run``'s keyword options to the frozen config of the component that reads each."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.run.engine import EngineConfig
from ddpkit.run.loader import DataConfig
from ddpkit.run.monitor import DiagnosticsConfig
from ddpkit.run.optim import OptimConfig
from ddpkit.run.state import CheckpointConfig

COMPONENTS = (DataConfig, EngineConfig, CheckpointConfig, OptimConfig, DiagnosticsConfig)


def split_options(options: dict[str, Any]) -> tuple:
    """One config per component, in ``COMPONENTS`` order; an unknown option is an error naming it."""
    owners = {f.name: cls for cls in COMPONENTS for f in fields(cls)}
    unknown = sorted(set(options) - set(owners))
    if unknown:
        raise ConfigError(f"ddpkit.Run got unknown options {unknown}; known ones are {sorted(owners)}")
    return tuple(cls(**{k: v for k, v in options.items() if owners[k] is cls}) for cls in COMPONENTS)
