"""ddpkit.Run under the variables a Kubeflow PyTorchJob, mpirun and srun give a process, simulated and real.

Each simulated launch starts 2 plain ``python scale_out_script.py OUT`` processes (or, for a pod
that runs ``ddpkit run``, one ``ddpkit run`` per pod) with exactly the variables that system sets,
none of torchrun's or ddpkit's, and checks that the run recognized its ranks and ended bit for bit
as ``ddpkit run --nproc 2`` did: model.pt and the loss of every step. Every process runs one thread
(OMP_NUM_THREADS=1), since float sums depend on the thread count. When Open MPI's ``mpirun`` is on
PATH, a real ``mpirun -np 2`` over gloo is checked the same way (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import logged_losses, wait_all

from ddpkit.dist import read_launcher_vars
from ddpkit.errors import ConfigError
from ddpkit.launch import free_port

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "scale_out_script.py"
STEPS = 30
TIMEOUT_S = 240  # every launch at once on 2 cores; a hang ends in SIGTERM and fails on the exit code
FOREIGN_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "MPI_", "PET_", "DDPKIT_", "RAY_")
FOREIGN_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "NODE_RANK"}  # fmt: skip
MPIRUN = shutil.which("mpirun")


def pytorchjob_pod(index: int, port: int, nproc: str = "auto") -> dict[str, str]:
    """A PyTorchJob pod (Master replica 0, Worker replica 1; training-operator 1.8 and later)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(index), "PET_NNODES": "2",
            "PET_NODE_RANK": str(index), "PET_NPROC_PER_NODE": nproc, "PYTHONUNBUFFERED": "0"}  # fmt: skip


def elastic_pod(port: int) -> dict[str, str]:
    """A pod of a PyTorchJob with an elasticPolicy and Worker replicas only: torchrun's c10d rendezvous."""
    return {"PET_RDZV_ENDPOINT": f"127.0.0.1:{port}", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1", "PET_MAX_RESTARTS": "0", "PYTHONUNBUFFERED": "0"}  # fmt: skip


def open_mpi(rank: int, port: int) -> dict[str, str]:
    """What Open MPI 4's mpirun -np 2 sets on one node, and the MASTER_* a user passes with -x."""
    world = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_UNIVERSE_SIZE": "2"}
    ranks = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_NODE_RANK", "PMIX_RANK")
    return {**world, **dict.fromkeys(ranks, str(rank)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def mpich(rank: int, port: int) -> dict[str, str]:
    """What MPICH's and Intel MPI's Hydra (mpiexec -n 2) set, and the MASTER_* passed with -genv."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


def srun_task(task: int, job_id: int) -> dict[str, str]:
    """What srun --ntasks=2 sets on one node (ddpkit's port is 15000 + SLURM_JOB_ID % 20000)."""
    return {"SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
            "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "127.0.0.1",
            "SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0"}  # fmt: skip


def _slurm_job_id() -> int:
    """A job id whose port (15000 + id) is free now: srun users set no MASTER_PORT."""
    for port in random.sample(range(15000, 35000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port - 15000
    raise AssertionError("no free port between 15000 and 35000")


def _launches(root: Path) -> dict[str, list[tuple[list[str], dict[str, str]]]]:
    """Launch name -> the processes it starts: (arguments after python, the system's variables)."""
    plain = lambda name: [str(SCRIPT), str(root / name)]  # noqa: E731
    ddpkit_run = lambda name: ["-m", "ddpkit", "run", str(SCRIPT), str(root / name)]  # noqa: E731
    job, job_run, elastic, ompi, hydra = (free_port() for _ in range(5))
    job_id = _slurm_job_id()
    no_master = {k: v for k, v in open_mpi(1, 0).items() if not k.startswith("MASTER_")}
    launches = {
        "reference": [(["-m", "ddpkit", "run", "--standalone", "--nproc", "2", *plain("reference")], {})],
        "pytorchjob": [(plain("pytorchjob"), pytorchjob_pod(i, job)) for i in (0, 1)],
        "pytorchjob_ddpkit_run": [(ddpkit_run("pytorchjob_ddpkit_run"), pytorchjob_pod(i, job_run, "1"))
                                  for i in (0, 1)],
        "elastic": [(ddpkit_run("elastic"), elastic_pod(elastic)) for _ in (0, 1)],
        "openmpi": [(plain("openmpi"), open_mpi(r, ompi)) for r in (0, 1)],
        "mpich": [(plain("mpich"), mpich(r, hydra)) for r in (0, 1)],
        "slurm": [(plain("slurm"), srun_task(t, job_id)) for t in (0, 1)],
        # rank 1 alone, no MASTER_*: must stop at once with the one-line fix, not wait for rank 0.
        "mpi_no_master": [(plain("mpi_no_master"), no_master)],
    }  # fmt: skip
    if MPIRUN is not None:
        mpirun = [MPIRUN, "-np", "2", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                  "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}",
                  "-x", "OMP_NUM_THREADS=1", sys.executable, *plain("mpirun")]  # fmt: skip
        launches["mpirun"] = [(mpirun, {})]
    return launches


@dataclass(frozen=True)
class Launch:
    out: Path
    returncodes: list[int]
    output: str


def _clean_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in FOREIGN_NAMES and not k.startswith(FOREIGN_PREFIXES)
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _start(args: list[str], extra: dict[str, str], log: Path) -> subprocess.Popen:
    command = args if args[0] == MPIRUN else [sys.executable, *args]
    with open(log, "w") as f:  # a file, not a pipe: nobody reads while they run
        return subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env={**_clean_env(), **extra})


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, Launch]:
    """Every launch at once, for the whole file (87 to 143 s on 2 cores at load averages 3 to 18)."""
    root = tmp_path_factory.mktemp("launcher_envs")
    started = {
        name: [_start(args, extra, root / f"{name}.{i}.log") for i, (args, extra) in enumerate(procs)]
        for name, procs in _launches(root).items()
    }
    codes = iter(
        wait_all([proc for procs in started.values() for proc in procs], time.monotonic() + TIMEOUT_S)
    )
    done = {}
    for name, procs in started.items():
        exits = [next(codes) for _ in procs]
        output = "\n".join((root / f"{name}.{i}.log").read_text()[-3000:] for i in range(len(procs)))
        done[name] = Launch(root / name, exits, output)
    return done


def _attempts(out: Path) -> list[dict]:
    lines = out.with_name(out.name + ".attempts.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda a: a["rank"])


def _assert_equals_reference(launches: dict[str, Launch], name: str) -> list[dict]:
    run, reference = launches[name], launches["reference"]
    for launch in (reference, run):
        assert launch.returncodes == [0] * len(launch.returncodes), (
            f"exits {launch.returncodes}:\n{launch.output}"
        )
    seen = _attempts(run.out)
    assert [(a["rank"], a["threads"]) for a in seen] == [(0, 1), (1, 1)], seen
    model, expected = (torch.load(x.out / "model.pt", weights_only=True) for x in (run, reference))
    differ = [k for k in expected if not torch.equal(model[k], expected[k])]
    assert model.keys() == expected.keys() and not differ, f"{name} ends with other weights in {differ}"
    losses = logged_losses(run.out)
    assert losses == logged_losses(reference.out) and len(losses) == STEPS and losses[-1] < losses[0], losses
    return seen


def test_a_pytorchjob_pod_running_the_script_is_one_process_per_node(launches):
    seen = _assert_equals_reference(launches, "pytorchjob")
    layout = [(a["launcher"], a["local_rank"], a["local_world_size"]) for a in seen]
    assert layout == [("pytorchjob", 0, 1)] * 2, seen


@pytest.mark.parametrize("name", ["pytorchjob_ddpkit_run", "elastic"])
def test_ddpkit_run_in_a_pod_reads_torchruns_pet_variables(launches, name):
    """PET_NNODES, PET_NODE_RANK, PET_MASTER_* (static) or PET_RDZV_* (c10d): two pods of one process."""
    seen = _assert_equals_reference(launches, name)
    assert [(a["local_rank"], a["local_world_size"]) for a in seen] == [(0, 1)] * 2, seen
    assert len({a["launcher"] for a in seen}) == 1 and seen[0]["launcher"] != "pytorchjob", seen


@pytest.mark.parametrize("name", ["openmpi", "mpich"])
def test_mpi_launcher_variables_give_the_ranks(launches, name):
    seen = _assert_equals_reference(launches, name)
    layout = [(a["launcher"], a["local_rank"], a["local_world_size"]) for a in seen]
    assert layout == [("mpi", 0, 2), ("mpi", 1, 2)], seen


def test_srun_tasks_take_their_ranks_from_slurm(launches):
    seen = _assert_equals_reference(launches, "slurm")
    layout = [(a["launcher"], a["local_rank"], a["local_world_size"]) for a in seen]
    assert layout == [("slurm", 0, 2), ("slurm", 1, 2)], seen


@pytest.mark.skipif(MPIRUN is None, reason="needs Open MPI's mpirun on PATH (apt-get install openmpi-bin)")
def test_a_real_mpirun_of_two_ranks_over_gloo(launches):
    seen = _assert_equals_reference(launches, "mpirun")
    assert [(a["launcher"], a["local_rank"]) for a in seen] == [("mpi", 0), ("mpi", 1)], seen


def test_mpirun_without_master_addr_stops_at_once_with_the_fix(launches):
    run = launches["mpi_no_master"]
    assert run.returncodes != [0], run.output
    assert "MASTER_ADDR and MASTER_PORT are not set" in run.output, run.output
    assert "mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500" in run.output, run.output


# Detection alone, without processes.

OMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}  # fmt: skip
SLURM_BATCH = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "node[0-1]"}


def test_open_mpi_variables_give_ranks_and_a_tcp_rendezvous():
    found = read_launcher_vars(OMPI)
    layout = (found.rank, found.local_rank, found.world_size, found.local_world_size, found.node_rank)
    assert layout == (5, 1, 8, 4, 1)
    assert (found.launcher, found.init_method) == ("mpi", "tcp://node0:29500")


def test_mpich_variables_give_ranks():
    found = read_launcher_vars({"PMI_RANK": "2", "PMI_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (found.rank, found.local_rank, found.world_size, found.local_world_size) == (2, 0, 3, 3)


def test_mpirun_inside_an_sbatch_script_takes_mpis_ranks_not_the_batch_steps():
    assert read_launcher_vars({**SLURM_BATCH, **OMPI}).rank == 5


@pytest.mark.parametrize(("given", "missing"), [({}, "MASTER_ADDR and MASTER_PORT are"),
                                                 ({"MASTER_ADDR": "h"}, "MASTER_PORT is")])  # fmt: skip
def test_mpi_without_master_is_one_line_naming_the_fix(given, missing):
    environ = {"PMI_RANK": "1", "PMI_SIZE": "2", **given}
    with pytest.raises(ConfigError, match=f"{missing} not set.*mpirun -genv MASTER_ADDR node0") as caught:
        read_launcher_vars(environ)
    assert "\n" not in str(caught.value)


def test_a_pytorchjob_pod_asking_for_more_processes_than_it_runs_is_an_error():
    with pytest.raises(ConfigError, match="PET_NPROC_PER_NODE=4 asks for 4 processes.*ddpkit run script.py"):
        read_launcher_vars({**pytorchjob_pod(1, 29500, "4"), "WORLD_SIZE": "8"})


def test_a_pod_that_runs_torchrun_keeps_torchruns_local_ranks():
    environ = {**pytorchjob_pod(1, 29500, "2"), "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
               "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}  # fmt: skip
    found = read_launcher_vars(environ)
    assert (found.rank, found.local_rank, found.local_world_size, found.launcher) == (3, 1, 2, "elastic")
