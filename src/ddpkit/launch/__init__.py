"""How processes are started: ``launch`` (mp.spawn, in-process) and the elastic agent (scripts)."""

from ddpkit.launch.elastic import add_launch_flags, run_elastic, run_parser
from ddpkit.launch.failures import LaunchError, WorkerFailure
from ddpkit.launch.ports import check_port_free, free_port
from ddpkit.launch.spawn import launch
from ddpkit.launch.stopping import Stopped

__all__ = [
    "LaunchError",
    "Stopped",
    "WorkerFailure",
    "add_launch_flags",
    "check_port_free",
    "free_port",
    "launch",
    "run_elastic",
    "run_parser",
]
