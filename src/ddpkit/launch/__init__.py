"""How processes are started: ``launch`` (mp.spawn, in-process) and the elastic agent (scripts)."""

from ddpkit.launch.elastic import WorkerFailure, add_launch_flags, run_elastic, run_parser
from ddpkit.launch.ports import check_port_free, free_port
from ddpkit.launch.spawn import LaunchError, launch

__all__ = [
    "LaunchError",
    "WorkerFailure",
    "add_launch_flags",
    "check_port_free",
    "free_port",
    "launch",
    "run_elastic",
    "run_parser",
]
