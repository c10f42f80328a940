"""ddpkit: data-parallel training for PyTorch, on every device available."""

from ddpkit.dist import DistEnv, destroy, init_distributed
from ddpkit.errors import ConfigError
from ddpkit.launch import LaunchError, launch
from ddpkit.parallel import DataParallel
from ddpkit.run import Run
from ddpkit.run.engine.materialize import empty_init
from ddpkit.run.engine.wrap import unwrap
from ddpkit.run.invariant.sample_rng import sample_rng
from ddpkit.run.state.ema import EMA, ema_warmup
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
    "sample_rng",
    "unwrap",
]
