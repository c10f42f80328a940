"""The front door for a user's own loop: ``ddpkit.Run`` and the config of each component it drives."""

from ddpkit.run.config import RunConfig
from ddpkit.run.engine import EngineConfig
from ddpkit.run.loader import DataConfig, Loader
from ddpkit.run.monitor import DiagnosticsConfig
from ddpkit.run.optim import OptimConfig
from ddpkit.run.run import Run
from ddpkit.run.state import CheckpointConfig

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
