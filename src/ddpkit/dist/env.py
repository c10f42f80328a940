"""Where ranks come from: the variables a launcher set, read once into plain values.

These launchers are understood, in this order:

- torchrun / ``ddpkit run`` / ``ddpkit train`` (the elastic agent), ``ddpkit.launch``, Ray Train:
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT.
- a Kubeflow PyTorchJob pod running the script as its one process: RANK (the pod's index),
  WORLD_SIZE, MASTER_ADDR, MASTER_PORT and torchrun's PET_NNODES, without LOCAL_RANK. A pod that
  runs ``ddpkit run`` or torchrun instead is the first case: they read PET_* themselves.
- mpirun: Open MPI's OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}, or MPICH's and Intel
  MPI's PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS; MASTER_ADDR and MASTER_PORT from
  the user. Before SLURM: mpirun inside an sbatch script inherits the batch step's SLURM_PROCID.
- SLURM's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID and the task layout.
- nothing: one process, a world of size 1.

This is the only module besides ``dist/init.py`` that reads ``os.environ``; everything else
gets a ``DistEnv`` passed in.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ddpkit.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    """The distributed state of one process, created once by ``init_distributed`` and passed in.

    Args:
        rank: global rank of this process, 0 .. world_size - 1.
        local_rank: rank among the processes of this node; picks the GPU.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, 0 .. num_nodes - 1.
        device: the device this process computes on.
        backend: the process-group backend: ``gloo``, ``nccl`` or ``mpi``.
        launcher: who started the process: ``elastic``, ``ddpkit``, ``env``, ``pytorchjob``,
            ``mpi``, ``slurm`` or ``none``.
        restart_count: how many times the elastic agent has restarted the workers (0 on the first run).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"
    launcher: str = "none"
    restart_count: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(
                f"local_rank {self.local_rank} is outside local_world_size {self.local_world_size}"
            )

    @property
    def is_rank0(self) -> bool:
        """True on the one process that writes files and logs."""
        return self.rank == 0

    @property
    def is_local_rank0(self) -> bool:
        """True on the first process of each node."""
        return self.local_rank == 0

    @property
    def collective_device(self) -> torch.device:
        """The device a collective's tensors must be on: this process's GPU under nccl, which
        communicates nothing else; the CPU under gloo and mpi, also when the model is on a GPU."""
        return self.device if self.backend == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class LauncherVars:
    """What a launcher told this process, before any device or backend is chosen.

    Args:
        rank: global rank.
        local_rank: rank on this node.
        world_size: processes in the job.
        local_world_size: processes on this node.
        node_rank: index of this node.
        launcher: ``elastic``, ``ddpkit``, ``env``, ``pytorchjob``, ``mpi``, ``slurm`` or ``none``.
        init_method: the rendezvous URL these variables imply, or None for a world of one.
        restart_count: the elastic agent's TORCHELASTIC_RESTART_COUNT.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    launcher: str = "none"
    init_method: str | None = None
    restart_count: int = 0


def read_launcher_vars(environ: Mapping[str, str] | None = None) -> LauncherVars:
    """Read rank and world layout from the variables a launcher set.

    Args:
        environ: the environment to read; ``os.environ`` when None.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        if "LOCAL_RANK" not in environ and "PET_NNODES" in environ:
            return _from_pytorchjob_pod(environ)
        return _from_torch_vars(environ)
    if "OMPI_COMM_WORLD_RANK" in environ or "PMI_RANK" in environ:
        return _from_mpi(environ)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return _from_slurm(environ)
    return LauncherVars()


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is not set; start the job with ddpkit run")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _from_torch_vars(environ: Mapping[str, str]) -> LauncherVars:
    world_size = _int(environ, "WORLD_SIZE")
    # Scripts started by hand with only RANK/WORLD_SIZE (the DDP tutorials' mp.spawn pattern) are one node.
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", world_size)
    launcher = environ.get("DDPKIT_LAUNCHER", "elastic" if "TORCHELASTIC_RUN_ID" in environ else "env")
    return LauncherVars(
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(environ, "GROUP_RANK", 0),
        launcher=launcher,
        init_method="env://",
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
    )


def _from_pytorchjob_pod(environ: Mapping[str, str]) -> LauncherVars:
    """A PyTorchJob pod whose one process is the script itself: RANK is the pod's index.

    The operator counts WORLD_SIZE as pods times PET_NPROC_PER_NODE (1 for its default "auto"),
    so a number above 1 there means processes that only torchrun would start: without them the
    rendezvous would wait for ranks that never come.
    """
    nproc = environ.get("PET_NPROC_PER_NODE", "1")
    if nproc.isdigit() and int(nproc) > 1:
        raise ConfigError(
            f"PET_NPROC_PER_NODE={nproc} asks for {nproc} processes in this pod, but the script was "
            "started as one plain process; start it with `ddpkit run script.py` (it reads PET_*), "
            'or set nprocPerNode: "1" in the PyTorchJob'
        )
    rank = _int(environ, "RANK")
    return LauncherVars(
        rank=rank,
        world_size=_int(environ, "WORLD_SIZE"),
        node_rank=rank,  # one process per pod: each pod is a node
        launcher="pytorchjob",
        init_method="env://",  # the operator sets MASTER_ADDR and MASTER_PORT
    )


# (rank, world size, local rank, local world size) as each MPI launcher names them.
MPI_VARS = {
    "Open MPI": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "MPICH or Intel MPI": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}
# How each passes a variable to every rank.
MPI_EXPORT = {
    "Open MPI": "-x MASTER_ADDR={addr} -x MASTER_PORT={port}",
    "MPICH or Intel MPI": "-genv MASTER_ADDR {addr} -genv MASTER_PORT {port}",
}


def _from_mpi(environ: Mapping[str, str]) -> LauncherVars:
    """Ranks from mpirun; where rank 0 listens from MASTER_ADDR and MASTER_PORT, which mpirun never
    sets: without them no rank could find the others, so their absence is an error, not a wait."""
    flavour = "Open MPI" if "OMPI_COMM_WORLD_RANK" in environ else "MPICH or Intel MPI"
    rank_var, size_var, local_rank_var, local_size_var = MPI_VARS[flavour]
    rank, world_size = _int(environ, rank_var), _int(environ, size_var)
    local_world_size = _int(environ, local_size_var, world_size)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing:
        example = MPI_EXPORT[flavour].format(addr="node0", port=29500)
        raise ConfigError(
            f"{flavour}'s mpirun started this process ({rank_var}={rank}) but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; pass rank 0's host and a free port to "
            f"every rank: mpirun {example} ..."
        )
    return LauncherVars(
        rank=rank,
        local_rank=_int(environ, local_rank_var, 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=rank // local_world_size,  # mpirun's default mapping fills one node, then the next
        launcher="mpi",
        init_method=f"tcp://{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
    )


def _from_slurm(environ: Mapping[str, str]) -> LauncherVars:
    world_size = _int(environ, "SLURM_NTASKS")
    node_rank = _int(environ, "SLURM_NODEID", 0)
    addr = environ.get("MASTER_ADDR") or first_slurm_host(environ.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    # Same job id -> same port on every node, without any communication.
    port = environ.get("MASTER_PORT") or str(15000 + _int(environ, "SLURM_JOB_ID", 0) % 20000)
    return LauncherVars(
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        world_size=world_size,
        local_world_size=slurm_tasks_on_node(environ.get("SLURM_TASKS_PER_NODE", ""), node_rank, world_size),
        node_rank=node_rank,
        launcher="slurm",
        init_method=f"tcp://{addr}:{port}",
    )


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: ``node[03-05,9],gpu1`` -> ``node03``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ConfigError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR to the first node")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_tasks_on_node(tasks_per_node: str, node_rank: int, world_size: int) -> int:
    """Tasks on node ``node_rank`` from SLURM_TASKS_PER_NODE, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, tasks_per_node.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ConfigError(f"cannot read SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not counts:
        return world_size
    return counts[min(node_rank, len(counts) - 1)]
