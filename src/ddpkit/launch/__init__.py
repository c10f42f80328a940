"""How processes are started: ``launch`` (mp.spawn, in-process) and the elastic agent (scripts)."""

from ddpkit.launch.elastic import run_elastic
from ddpkit.launch.failures import LaunchError, WorkerFailure
from ddpkit.launch.ports import check_port_free, free_port
from ddpkit.launch.spawn import launch
from ddpkit.launch.stopping import Stopped
from ddpkit.launch.torchrun_flags import add_launch_flags, run_parser

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
