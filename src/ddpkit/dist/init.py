"""Process-group set-up and tear-down: one call gives a ready ``DistEnv``."""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import os
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from ddpkit.choices import BACKENDS
from ddpkit.dist import gloo_threads
from ddpkit.dist.env import DistEnv, read_launcher_vars
from ddpkit.dist.threads import share_cores, warn_if_oversubscribed
from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)

# Start-up waits for every rank to arrive, which on a busy cluster can take minutes (the
# "skewed processing speeds" of PyTorch's DDP tutorials); a generous default avoids spurious
# timeouts there.
DEFAULT_TIMEOUT = timedelta(minutes=30)


def resolve_backend(backend: str, local_world_size: int, gpu_count: int | None = None) -> str:
    """Turn ``auto`` into a concrete backend and check that the choice can work here.

    Args:
        backend: ``auto``, ``gloo``, ``nccl`` or ``mpi``.
        local_world_size: processes on this node, each of which needs its own GPU for nccl.
        gpu_count: GPUs visible; ``torch.cuda.device_count()`` when None.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if gpu_count is None else gpu_count
    if backend == "auto":
        return "nccl" if gpus >= local_world_size > 0 and gpus > 0 else "gloo"
    if backend == "nccl" and gpus < local_world_size:
        fix = f"--nproc {gpus} or --backend gloo" if gpus else "--backend gloo on a machine without GPUs"
        raise ConfigError(
            f"backend nccl needs one GPU per process: {local_world_size} processes on this node "
            f"but {gpus} GPUs visible; use {fix}"
        )
    if backend == "mpi" and not dist.is_mpi_available():
        raise ConfigError("backend mpi needs a torch built with MPI, and this one is not; use --backend gloo")
    return backend


def _device_for(backend: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def init_distributed(
    backend: str = "auto",
    init_method: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> DistEnv:
    """Join the process group described by the launcher's variables and return this process's DistEnv.

    One code path for one process and many: without any launcher this makes a world of size 1.
    The device is set before the process group is created, so NCCL binds each rank to its own GPU.

    Args:
        backend: ``auto`` (nccl when every local rank has a GPU, else gloo), ``gloo``, ``nccl``, ``mpi``.
        init_method: ``env://``, ``tcp://HOST:PORT`` or ``file://PATH``; None takes what the launcher set.
        rank: global rank, for tcp:// and file:// without a launcher; None takes the launcher's.
        world_size: world size likewise.
        timeout: how long collectives and start-up wait for the other ranks.
    """
    found = read_launcher_vars()
    rank = found.rank if rank is None else rank
    world_size = found.world_size if world_size is None else world_size
    local_world_size, local_rank = found.local_world_size, found.local_rank
    chosen = resolve_backend(backend, local_world_size)
    device = _device_for(chosen, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    share_cores(local_world_size)
    _init_group(chosen, init_method or found.init_method, rank, world_size, timeout)
    if device.type == "cpu":  # once per process, here, rather than a collective in every engine
        warn_if_oversubscribed()
    # Once per process (unregister first, so repeated inits do not stack up handlers).
    atexit.unregister(release_process_groups)
    atexit.register(release_process_groups)
    env = DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=found.node_rank,
        device=device,
        backend=chosen,
        launcher=found.launcher,
        restart_count=found.restart_count,
    )
    log.debug("joined process group: %s", env)
    return env


def current_env() -> DistEnv:
    """The DistEnv of a process group that already exists (a script that called init_process_group).

    Ranks come from the group itself; the node layout from the launcher's variables.
    """
    found = read_launcher_vars()
    backend = dist.get_backend()
    local_rank = found.local_rank if found.local_world_size > 1 else 0
    return DistEnv(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        local_world_size=max(found.local_world_size, local_rank + 1),
        node_rank=found.node_rank,
        device=_device_for(backend, local_rank),
        backend=backend,
        launcher=found.launcher,
        restart_count=found.restart_count,
    )


def _init_group(
    backend: str, init_method: str | None, rank: int, world_size: int, timeout: timedelta
) -> None:
    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialized in this process; call ddpkit.destroy() first"
        )
    if init_method is None:
        if world_size != 1:
            raise ConfigError(
                f"world_size {world_size} needs an init_method (env://, tcp://HOST:PORT or file://PATH) "
                "or a launcher such as ddpkit run"
            )
        # A world of one needs no rendezvous: an in-memory store is enough.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    _check_init_method(init_method)
    store = _restart_safe_agent_store(init_method, timeout)
    if store is not None:
        # A second group in the same process (two Runs one after the other) would otherwise read
        # the first one's gloo addresses and wait forever; every rank makes its groups in order.
        store = dist.PrefixStore(f"group{next(_GROUPS)}", store)
    store = store or _tcp_store_under_ddpkit_launch(init_method, rank, world_size, timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        return
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )


_GROUPS = itertools.count()  # the agent-store groups this process made: each its own key space


def _restart_safe_agent_store(init_method: str, timeout: timedelta) -> dist.Store | None:
    """Under torchrun's agent, a store whose keys are private to this restart attempt.

    The agent keeps one TCPStore for the whole job and every restart of the workers connects to
    it again. Without a prefix per attempt, a restarted rank can read a dead peer's gloo address
    left by the previous attempt and fail with "Connection refused" (pytorch issue 167288).
    """
    if init_method != "env://" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ddpkit/attempt{attempt}", client)


def _tcp_store_under_ddpkit_launch(
    init_method: str, rank: int, world_size: int, timeout: timedelta
) -> dist.Store | None:
    """For tcp:// under ddpkit.launch: the store at HOST:PORT, hosted by rank 0.

    ddpkit.launch tells its ranks that an agent hosts their store (TORCHELASTIC_USE_AGENT_STORE,
    for env://), so torch's own tcp:// handler would connect every rank, rank 0 too, to HOST:PORT
    as a client of a store nobody hosts, and wait there until the timeout.
    """
    if not init_method.startswith("tcp://") or os.environ.get("DDPKIT_LAUNCHER") != "ddpkit":
        return None
    url = urlsplit(init_method)
    return dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0, timeout=timeout)


def job_store(timeout: timedelta) -> dist.Store | None:
    """A store every rank of this job (and restart attempt) shares, for a word between ranks
    outside any collective: torchrun's agent store when it shares one (it outlives every worker),
    else the default process group's; None with neither.

    Args:
        timeout: how long connecting to the agent's store and each wait on it may take.
    """
    try:
        store = _restart_safe_agent_store("env://", timeout)
        if store is None and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
    except Exception:  # the agent is gone, or the group half torn down: no word to share
        return None
    return store


def _check_init_method(init_method: str) -> None:
    if not init_method.startswith(("env://", "tcp://", "file://")):
        raise ConfigError(
            f"unsupported init_method {init_method!r}; use env://, tcp://HOST:PORT or file:///PATH"
        )


def set_collective_timeout(timeout: timedelta) -> None:
    """Give the joined group's collectives ``timeout``, after joining it with another (start-up) one."""
    dist.distributed_c10d._set_pg_timeout(timeout)


def destroy() -> None:
    """Leave the process group; safe to call twice or when none was created.

    Gloo's worker threads are let go idle first (``gloo_threads.settle``): whatever frees the
    group later, a DDP model's Reducer included, then finds them waiting for work, not for the GIL.
    """
    if dist.is_available() and dist.is_initialized():
        gloo_threads.settle()
        dist.destroy_process_group()


def release_process_groups() -> None:
    """At exit: free unreachable objects that still hold a process group (a DDP model in a cycle).

    Otherwise the group's gloo threads are torn down during interpreter shutdown, which can
    abort the process ("terminate called without an active exception", SIGABRT) after a run that
    finished well. ``init_distributed`` registers this with atexit, which runs while the
    interpreter is still alive, so every script, launcher child and worker gets it.

    A group can also outlive ``destroy_process_group`` where nothing in Python can free it:
    ``torch.profiler`` keeps references to every group that existed while it ran (torch 2.13). A
    gloo worker thread of such a group drops the last collective's tensors a moment after the
    collective completes, and that drop takes the GIL; once the interpreter is shutting down, the
    thread is made to exit there, which aborts the process the same way. So the threads are let
    go idle before the collection (which may free a group) and after it.
    """
    gloo_threads.settle()
    gc.collect()
    gloo_threads.settle()
