"""The flags of ``ddpkit run`` and of ``ddpkit train``'s launch, and their checks.

``ddpkit run`` accepts every torchrun flag (``run_parser`` is torchrun's own parser), adds
``--nproc`` as a short name for ``--nproc-per-node``, and ``ddpkit train`` shares the launch
flags in ``LAUNCH_FLAGS``. What a user can get wrong in them is checked here, before any process
starts; ``elastic`` then runs torch's agent with them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed.run as torchrun

from ddpkit.dist import cpu_cores
from ddpkit.errors import ConfigError
from ddpkit.launch.ports import check_port_free
from ddpkit.launch.rendezvous import node_zero_port_taken
from ddpkit.launch.stopping import GRACE_HELP, GRACE_S, PREEMPT_HELP, parse_signal
from ddpkit.logs import log_level

LOG_LEVEL_HELP = "ddpkit's log lines in the workers: debug, info (default), warning or error"

# The torchrun flags `ddpkit train` shares with `ddpkit run`: (flags, argparse keyword arguments).
LAUNCH_FLAGS: list[tuple[tuple[str, ...], dict]] = [
    (
        ("--nproc", "--nproc-per-node", "--nproc_per_node"),
        {"default": "auto", "help": "processes on this node: a number, or auto (GPU count, else CPU cores)"},
    ),
    (("--nnodes",), {"default": "1", "help": "nodes, or MIN:MAX for an elastic job"}),
    (
        ("--node-rank", "--node_rank"),
        {"type": int, "default": 0, "help": "this node's index (static rendezvous)"},
    ),
    (("--master-addr", "--master_addr"), {"default": "127.0.0.1", "help": "address of node 0"}),
    (("--master-port", "--master_port"), {"type": int, "default": None, "help": "port on node 0"}),
    (("--rdzv-backend", "--rdzv_backend"), {"default": "static", "help": "static or c10d"}),
    (("--rdzv-endpoint", "--rdzv_endpoint"), {"default": "", "help": "HOST:PORT of the c10d rendezvous"}),
    (("--rdzv-id", "--rdzv_id"), {"default": "none", "help": "job id shared by all nodes"}),
    (("--max-restarts", "--max_restarts"), {"type": int, "default": 0, "help": "restarts before failing"}),
    (
        ("--rdzv-conf", "--rdzv_conf"),
        {
            "default": "",
            "help": "rendezvous settings K=V,...: timeout (static), join_timeout, last_call_timeout, "
            "read_timeout, keep_alive_interval (c10d); seconds",
        },
    ),
    (
        ("--local-addr", "--local_addr"),
        {"default": None, "help": "this node's address as the other nodes reach it (c10d)"},
    ),
    (("--standalone",), {"action": "store_true", "help": "single node, rendezvous on a free local port"}),
    (
        ("--grace-period", "--grace_period"),
        {"type": int, "default": int(GRACE_S), "metavar": "SECONDS", "help": GRACE_HELP},
    ),
    (("--preempt-signal", "--preempt_signal"), {"default": None, "metavar": "SIGNAL", "help": PREEMPT_HELP}),
    (
        ("--log-level",),
        {
            "default": None,
            "help": "ddpkit's log lines: debug, info (default), warning or error",
        },
    ),
]


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """Add the torchrun launch flags to a ``ddpkit`` sub-command's parser."""
    group = parser.add_argument_group("launch (the same flags as torchrun / ddpkit run)")
    for flags, kwargs in LAUNCH_FLAGS:
        group.add_argument(*flags, **kwargs)


def torchrun_argv(ns: argparse.Namespace) -> list[str]:
    """Turn parsed launch flags back into torchrun's command line (script arguments not included)."""
    argv = [
        "--nproc-per-node",
        str(ns.nproc),
        "--nnodes",
        ns.nnodes,
        "--node-rank",
        str(ns.node_rank),
        "--master-addr",
        ns.master_addr,
        "--rdzv-backend",
        ns.rdzv_backend,
        "--rdzv-id",
        ns.rdzv_id,
        "--max-restarts",
        str(ns.max_restarts),
    ]
    if ns.master_port is not None:
        argv += ["--master-port", str(ns.master_port)]
    if ns.rdzv_endpoint:
        argv += ["--rdzv-endpoint", ns.rdzv_endpoint]
    if ns.rdzv_conf:
        argv += ["--rdzv-conf", ns.rdzv_conf]
    if ns.local_addr:
        argv += ["--local-addr", ns.local_addr]
    if ns.standalone:
        argv.append("--standalone")
    # run_parser() reads them back (torchrun's --shutdown-timeout exists only from torch 2.12), so
    # `ddpkit run` and `ddpkit train` share run_elastic's reading.
    argv += ["--grace-period", str(ns.grace_period)]
    if ns.preempt_signal:
        preempt = parse_signal(ns.preempt_signal).name  # the error names --preempt-signal
        argv += ["--signals-to-handle", f"SIGTERM,SIGINT,SIGHUP,SIGQUIT,{preempt}"]
    return argv


def run_parser() -> argparse.ArgumentParser:
    """torchrun's own parser, named ``ddpkit run``, with ``--nproc`` as a short flag."""
    parser = torchrun.get_args_parser()
    parser.prog = "ddpkit run"
    parser.description = "Launch a training script on every process, exactly like torchrun."
    # Same destination as --nproc-per-node; SUPPRESS keeps torchrun's default when it is absent.
    parser.add_argument(
        "--nproc",
        dest="nproc_per_node",
        default=argparse.SUPPRESS,
        help="short for --nproc-per-node; auto = GPU count, or one per CPU core",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        help="seconds a collective may wait before the launcher reports which ranks did not reach it, "
        "with every rank's stack, and ends the run (default: 90%% of the script's own process-group "
        "timeout, 27 minutes for gloo's default; 0: off)",
    )
    # torchrun's --shutdown-timeout (torch 2.12 and later) under ddpkit's name. argparse sets the
    # first action's default, so torchrun's stands where it has the flag, None where it has not.
    parser.add_argument(
        "--grace-period",
        dest="shutdown_timeout",
        type=int,
        default=None,
        metavar="SECONDS",
        help=GRACE_HELP,
    )
    parser.add_argument("--preempt-signal", default=None, metavar="SIGNAL", help=PREEMPT_HELP)
    parser.add_argument("--log-level", default=None, help=LOG_LEVEL_HELP)
    return parser


def resolve_nproc(value: str) -> int:
    """Processes per node from ``--nproc``: a positive number, ``auto``, ``cpu`` or ``gpu``."""
    if value == "auto":
        return torch.cuda.device_count() or cpu_cores()
    if value == "cpu":
        return cpu_cores()
    if value == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError("--nproc gpu needs GPUs and none is visible; use --nproc auto or a number")
        return torch.cuda.device_count()
    try:
        nproc = int(value)
    except ValueError:
        raise ConfigError(f"--nproc {value!r} is not a number; use a positive integer or auto") from None
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} is below 1; use a positive integer or auto")
    return nproc


def nnodes_range(value: str) -> tuple[int, int]:
    """``--nnodes`` as (min, max): ``2`` -> (2, 2), ``1:4`` -> (1, 4)."""
    parts = value.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if not 0 < low <= high:
        raise ConfigError(
            f"--nnodes {value!r} is not N or MIN:MAX with 1 <= MIN <= MAX; for example --nnodes 2"
        )
    return low, high


def check_launch_args(ns: argparse.Namespace) -> None:
    """Check launch flags in place (``nproc_per_node`` becomes a number) before any process starts."""
    ns.nproc_per_node = str(resolve_nproc(str(ns.nproc_per_node)))
    low, high = nnodes_range(ns.nnodes)
    if ns.max_restarts < 0:
        raise ConfigError(f"--max-restarts {ns.max_restarts} is below 0; use 0 or more")
    if getattr(ns, "log_level", None) is not None:
        log_level(ns.log_level)
    if ns.shutdown_timeout is not None and ns.shutdown_timeout < 0:
        raise ConfigError(f"--grace-period {ns.shutdown_timeout} is below 0; give seconds, 0 or more")
    if ns.rdzv_backend == "static" and not ns.standalone:
        check_static_nodes(ns.node_rank, low, high)
    hosts_store = ns.rdzv_backend == "static" and not ns.rdzv_endpoint and ns.node_rank == 0
    if ns.master_port is not None and hosts_store and not ns.standalone:
        try:
            check_port_free(ns.master_port)
        except ConfigError:
            if high == 1:
                raise
            raise node_zero_port_taken(ns.master_port) from None


def check_static_nodes(node_rank: int, low: int, high: int) -> None:
    """A static rendezvous has a fixed node count, and this node's rank must lie in it."""
    if low != high:
        raise ConfigError(
            f"--nnodes {low}:{high} needs --rdzv-backend c10d: a static rendezvous has a fixed node count; "
            f"use --nnodes {high}, or add --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
        )
    if not 0 <= node_rank < high:
        raise ConfigError(
            f"--node-rank {node_rank} is outside 0 to {high - 1} for --nnodes {high}; "
            "give each node its own --node-rank in that range"
        )


def check_script(ns: argparse.Namespace) -> None:
    """A missing script would fail in every worker at once; say so here, once."""
    if ns.module or ns.no_python:
        return
    if not Path(ns.training_script).is_file():
        raise ConfigError(f"script {ns.training_script!r} does not exist; give the path of a Python file")
