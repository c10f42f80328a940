"""The front door for a user's own loop: ``ddpkit.Run`` and the config of each component it drives."""

from ddpkit.run.config import (
    CheckpointConfig,
    DataConfig,
    DiagnosticsConfig,
    EngineConfig,
    OptimConfig,
    RunConfig,
)
from ddpkit.run.data.loader import Loader
from ddpkit.run.run import Run

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DiagnosticsConfig",
    "EngineConfig",
    "Loader",
    "OptimConfig",
    "Run",
    "RunConfig",
]
