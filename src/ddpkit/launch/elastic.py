"""The script launcher: PyTorch's own elastic agent (torch.distributed.run), with friendlier checks.

``ddpkit run`` and ``ddpkit train`` start their workers here, under torch's agent, after the
checks of ``torchrun_flags``; every rendezvous goes through ddpkit's checked variants, a hang
monitor watches the collectives, signals stop the workers in order, and a worker failure
becomes a short report naming the rank.
"""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path

import torch
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch

from ddpkit.diagnostics.hang.exchange import watchdog_verdict
from ddpkit.diagnostics.hang.monitor import HangMonitor
from ddpkit.errors import ConfigError
from ddpkit.launch.boot_errors import CONFIG_ERROR
from ddpkit.launch.failures import WorkerFailure, quiet_after_user_error, user_error, write_exit_stacks
from ddpkit.launch.rendezvous import checked_backend
from ddpkit.launch.restarts import RestartLine
from ddpkit.launch.stopping import GRACE_S, StopOnSignal, failure_grace, split_signals
from ddpkit.launch.stores import peer_unreachable
from ddpkit.launch.torchrun_flags import check_launch_args, nnodes_range
from ddpkit.launch.workerenv import environment, run_directory, worker_variables


def launch_agent(ns: argparse.Namespace, monitor: HangMonitor) -> None:
    """``torchrun.run(ns)``, with every rendezvous through ddpkit's checked, bound variants.

    The same steps as torchrun's ``run``: a single node without an address gets a private c10d
    rendezvous on a free local port; static and c10d are swapped for the variants in
    ``ddpkit.launch.rendezvous``, which turn bad multi-node input into one-line errors, listen on
    one address (loopback for one node) and give the workers a fresh store per round.
    """
    _, high = nnodes_range(ns.nnodes)
    single = ns.rdzv_backend == "static" and not ns.rdzv_endpoint and ns.master_port is None and high == 1
    if ns.standalone or single:
        ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        ns.nnodes = "1"
    if ns.master_port is None:
        ns.master_port = 29500  # torchrun's default; only the static rendezvous uses it
    config, entrypoint, args = torchrun.config_from_args(ns)
    config.rdzv_backend = checked_backend(config.rdzv_backend)
    config.rdzv_configs["ddpkit_hooks"] = monitor  # read by the rendezvous factories: on_round
    elastic_launch(config, entrypoint)(*args)


def run_elastic(ns: argparse.Namespace, collective_timeout: float | None = 0.0) -> None:
    """Start the workers under torchrun's elastic agent and wait for them.

    Args:
        ns: torchrun's parsed flags.
        collective_timeout: seconds a collective may take before the launcher reports a hang
            and ends the round; None: 90% of the script's own process-group timeout; 0: no
            monitoring (``ddpkit train`` has its own, in the workers).

    Raises:
        ConfigError: a bad flag, found before anything starts, bad multi-node input found at
            the rendezvous (see ``ddpkit.launch.rendezvous``), or a worker's own ConfigError.
        WorkerFailure: a worker failed (after any restarts); the message names the rank, or the hang.
        Stopped: a signal stopped the launcher (``ddpkit.launch.stopping``); its line is printed,
            and the exit code is 128 + the signal.
    """
    check_launch_args(ns)
    if collective_timeout is not None and collective_timeout < 0:
        raise ConfigError(
            f"--collective-timeout {collective_timeout:g} is below 0; "
            "give seconds, or 0 to turn hang reports off"
        )
    signals, ns.signals_to_handle = split_signals(ns.signals_to_handle, getattr(ns, "preempt_signal", None))
    grace = GRACE_S if ns.shutdown_timeout is None else ns.shutdown_timeout
    with run_directory() as run_dir:
        restarts = RestartLine(ns.max_restarts, run_dir).install()  # one line per restart, naming who failed
        monitor = HangMonitor(
            run_dir,
            collective_timeout,
            announce=ns.max_restarts > 0,
            new_round=restarts.on_round,
            forget=(f"{CONFIG_ERROR}*",),
        )
        watched = collective_timeout != 0
        progress_s = monitor.poll_s if watched else 0.0
        variables = worker_variables(run_dir, int(ns.nproc_per_node), progress_s)
        if getattr(ns, "log_level", None) is not None:
            variables["DDPKIT_LOG_LEVEL"] = ns.log_level
        with environment(variables):
            stop = StopOnSignal(signals, float(grace))
            try:
                with stop, failure_grace(grace), quiet_after_user_error(run_dir):
                    if watched:
                        monitor.start()
                    try:
                        launch_agent(ns, monitor)
                    except ChildFailedError as exc:
                        if (error := user_error(run_dir)) is not None:
                            raise error from None  # a worker's ConfigError: one line, exit code 2
                        raise _failure(exc, monitor, run_dir) from None
                    except torch.distributed.DistStoreError:
                        # torch's agent timed out waiting for another node's role in the round.
                        if (why := peer_unreachable(monitor.round_store)) is None:
                            raise
                        raise ConfigError(why) from None
                    finally:
                        monitor.stop()
                        restarts.uninstall()
            except SignalException as exc:
                raise stop.report(exc.sigval) from None


def _failure(exc: ChildFailedError, monitor: HangMonitor, run_dir: Path) -> WorkerFailure:
    """The failure to report: a hang if the launcher saw one, else the first rank that failed."""
    # The monitor's own verdict, else the hang a rank's HangWatchdog reported (``ddpkit train``).
    hang = monitor.verdict or watchdog_verdict(monitor.worker_store)
    return WorkerFailure.from_child_failed(exc, hang=hang, others=write_exit_stacks(run_dir))
