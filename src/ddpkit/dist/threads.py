"""CPU oversubscription: more compute threads on a host than it has cores.

The most common reason a DDP script on CPU is slow. Torch gives every process one intra-op
thread per core, so N processes on one host run N times too many threads. OpenMP threads that
wait for work spin instead of sleeping, and they spin against the other processes' threads and
against gloo's communication threads: on 2 cores this about doubles a torch DDP step, with or
without communication (docs/engine.md, "Where a slow CPU DDP step goes", measured with
``ddpkit bench engine --threads 2``).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.distributed as dist

from ddpkit.dist.env import read_launcher_vars

log = logging.getLogger("ddpkit")


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset and cgroup CPU sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def share_cores(local_world_size: int) -> None:
    """Give this process its share of the host's cores, ``cores // local_world_size`` intra-op
    threads, unless ``OMP_NUM_THREADS`` is set (a user's or the launcher's choice stands).

    Args:
        local_world_size: processes of the job on this host.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, cpu_cores() // local_world_size))


def oversubscription(threads: int, local_processes: int, cores: int) -> str | None:
    """Why this host's CPU is oversubscribed by threads and how to fix it, or None when it is not.

    Single-threaded processes are left alone even when they outnumber the cores: running more
    processes than cores is a deliberate choice (trying a world size out on a laptop), and there
    is no thread count to lower.

    Args:
        threads: intra-op threads of each process (``torch.get_num_threads()``).
        local_processes: processes of the job on this host.
        cores: CPU cores this process may use.
    """
    if threads == 1 or threads * local_processes <= cores:
        return None
    share = max(1, cores // local_processes)
    return (
        f"{local_processes} processes on this host x {threads} threads each = "
        f"{threads * local_processes} compute threads on {cores} CPU cores; oversubscribed threads "
        f"spin against each other and against gloo, which can double the step time. "
        f"Call torch.set_num_threads({share}) in each process (ddpkit.init_distributed does)"
    )


def warn_if_oversubscribed(*, on_cpu: bool = True) -> str | None:
    """Log a warning when this host runs more compute threads than it has cores; return it.

    No collective: the processes on this host are the launcher's LOCAL_WORLD_SIZE. The same
    warning is logged once per process, however many models are wrapped.

    Args:
        on_cpu: whether this rank computes on the CPU; a GPU rank's threads only feed the GPU.
    """
    if not on_cpu:
        return None
    problem = oversubscription(torch.get_num_threads(), read_launcher_vars().local_world_size, cpu_cores())
    if problem is not None:
        _warn_once(f"rank {dist.get_rank() if dist.is_initialized() else 0}: {problem}")
    return problem


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)
