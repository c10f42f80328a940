"""ddpkit: data-parallel training for PyTorch, on every device available."""

from ddpkit.dist import DistEnv, destroy, init_distributed
from ddpkit.errors import ConfigError
from ddpkit.launch import LaunchError, launch
from ddpkit.parallel import DataParallel
from ddpkit.run import Run
from ddpkit.run.ema import EMA, ema_warmup
from ddpkit.run.engine import unwrap
from ddpkit.run.materialize import empty_init
from ddpkit.train.task import Task
from ddpkit.version import __version__

__all__ = [
    "ConfigError",
    "DataParallel",
    "DistEnv",
    "EMA",
    "LaunchError",
    "Run",
    "Task",
    "__version__",
    "destroy",
    "ema_warmup",
    "empty_init",
    "init_distributed",
    "launch",
    "unwrap",
]
