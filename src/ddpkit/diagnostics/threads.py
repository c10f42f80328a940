"""CPU oversubscription: more compute threads on a host than it has cores.

The most common reason a DDP script on CPU is slow. Torch gives every process one intra-op
thread per core, so N processes on one host run N times too many threads. OpenMP threads that
wait for work spin instead of sleeping, and they spin against the other processes' threads and
against gloo's communication threads. Measured with ``ddpkit bench engine --threads 2`` on a
2-core machine (2 processes, 4.8M-parameter GPT): 686 ms per torch DDP step, against 358 ms
with one thread per process; without any communication the oversubscribed step still took 656 ms.
"""

from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist

from ddpkit.dist import cpu_cores

log = logging.getLogger("ddpkit")


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


def local_processes(process_group: dist.ProcessGroup | None = None) -> int:
    """How many ranks of ``process_group`` run on this host. A collective (all_gather_object)."""
    hosts: list[str | None] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(hosts, socket.gethostname(), group=process_group)
    return hosts.count(socket.gethostname())


def warn_if_oversubscribed(
    process_group: dist.ProcessGroup | None = None, *, on_cpu: bool = True
) -> str | None:
    """Log a warning when this host runs more compute threads than it has cores; return it.

    A collective: every rank of ``process_group`` must call it, whatever its ``on_cpu``.

    Args:
        process_group: the ranks of the job; the default group when None.
        on_cpu: whether this rank computes on the CPU; a GPU rank's threads only feed the GPU.
    """
    processes = local_processes(process_group)
    problem = oversubscription(torch.get_num_threads(), processes, cpu_cores()) if on_cpu else None
    if problem is not None:
        log.warning("rank %d: %s", dist.get_rank(), problem)
    return problem
