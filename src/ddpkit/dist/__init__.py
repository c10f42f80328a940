"""Distributed environment: who the ranks are, and the process group they share."""

from ddpkit.dist.env import DistEnv, LauncherVars, read_launcher_vars
from ddpkit.dist.threads import cpu_cores
from ddpkit.dist.init import current_env, destroy, init_distributed, resolve_backend

__all__ = [
    "DistEnv",
    "LauncherVars",
    "cpu_cores",
    "current_env",
    "destroy",
    "init_distributed",
    "read_launcher_vars",
    "resolve_backend",
]
