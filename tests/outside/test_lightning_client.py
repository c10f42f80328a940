"""`ddpkit run` launches an unmodified PyTorch Lightning script exactly as torchrun does.

lightning_client_script.py is a Lightning user's torchrun script (Trainer with strategy="ddp",
devices=2). It runs twice, once under ``ddpkit run`` and once under ``torch.distributed.run``, and
the tests check from the outside what each worker wrote: the launcher started both workers and
Lightning joined them as a torchelastic job (it spawned none of its own), and training ended with
the same weights on both ranks, bit for bit those of the torchrun run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("lightning_client_script.py")
MAX_STEPS = 20  # 8 steps an epoch on 2 ranks: the DistributedSampler reshuffles twice
TIMEOUT_S = 120  # both launches together; a hang ends in SIGTERM and fails on the return code
# Inherited variables that would change who Lightning thinks started it, or how it seeds: a
# pytest run inside torchrun, SLURM or a Lightning job must not leak its ranks into these runs.
FOREIGN_PREFIXES = ("PL_", "LIGHTNING_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "LSB_")
FOREIGN_NAMES = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
}


@dataclass(frozen=True)
class Launch:
    out: Path
    launcher_pid: int
    returncode: int
    output: str
    ranks: dict[int, dict]  # global rank -> what that worker wrote in rank{r}.json
    weights: dict[int, dict[str, torch.Tensor]]  # global rank -> its final state_dict


def _clean_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in FOREIGN_NAMES and not k.startswith(FOREIGN_PREFIXES)
    }
    env["PYTHONUNBUFFERED"] = "1"  # a failing worker's last lines reach the assertion message
    # Bit-equality needs equal thread counts: torchrun gives each of its 2 workers 1 thread, ddpkit
    # run cores / 2 (the same only on 2 cores), and a float sum over 2 threads need not equal one
    # over 1.
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(launcher: list[str], out: Path) -> subprocess.Popen:
    # --standalone: a c10d rendezvous on a free port under both launchers, so the two launches
    # here, and test files running beside this one, never collide on torchrun's default 29500.
    command = [sys.executable, "-m", *launcher, "--standalone", str(SCRIPT), str(out), "2", str(MAX_STEPS)]
    out.mkdir()
    with open(out / "output.log", "w") as log:  # a file, not a pipe: nobody reads while both run
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_clean_env())


def _finish(proc: subprocess.Popen, out: Path, deadline: float) -> Launch:
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        # A hang. SIGTERM, not SIGKILL: both launchers stop their workers on it, where a SIGKILLed
        # torchrun would leave them running (conftest fails a test that leaves any behind).
        proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    output = (out / "output.log").read_text()
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}
    weights = {int(p.stem[4:]): torch.load(p, weights_only=True) for p in sorted(out.glob("rank*.pt"))}
    return Launch(out, proc.pid, proc.returncode, output, ranks, weights)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Launch]:
    """Both launches, once for the whole file and side by side (about 11 s together on 2 cores)."""
    root = tmp_path_factory.mktemp("lightning_client")
    launchers = {
        "ddpkit": ["ddpkit", "run", "--nproc", "2"],
        "torchrun": ["torch.distributed.run", "--nproc-per-node", "2"],
    }
    procs = {name: _start(launcher, root / name) for name, launcher in launchers.items()}
    deadline = time.monotonic() + TIMEOUT_S
    return {name: _finish(proc, root / name, deadline) for name, proc in procs.items()}


@pytest.mark.parametrize("launcher", ["ddpkit", "torchrun"])
def test_the_script_finishes_on_every_rank(runs, launcher):
    run = runs[launcher]
    assert run.returncode == 0, f"{launcher} exited {run.returncode}:\n{run.output[-4000:]}"
    assert sorted(run.ranks) == [0, 1], f"rank files from {sorted(run.ranks)}:\n{run.output[-4000:]}"
    assert [run.ranks[r]["global_step"] for r in (0, 1)] == [MAX_STEPS, MAX_STEPS]


def test_ddpkit_run_started_two_workers_and_lightning_joined_them(runs):
    run = runs["ddpkit"]
    assert run.returncode == 0, run.output[-4000:]
    seen = [run.ranks[r] for r in (0, 1)]
    assert [s["global_rank"] for s in seen] == [0, 1]
    assert [s["local_rank"] for s in seen] == [0, 1]
    assert [s["world_size"] for s in seen] == [2, 2]
    assert len({s["pid"] for s in seen}) == 2, seen
    # Both workers are the launcher's own children: had Lightning started its processes, the
    # second would be a child of the first and the launcher would have started only one.
    assert [s["ppid"] for s in seen] == [run.launcher_pid] * 2, (run.launcher_pid, seen)
    for r, s in enumerate(seen):
        assert s["env"]["RANK"] == str(r) and s["env"]["LOCAL_RANK"] == str(r), s["env"]
        assert s["env"]["WORLD_SIZE"] == "2" and s["env"]["LOCAL_WORLD_SIZE"] == "2", s["env"]
    run_ids = {s["env"]["TORCHELASTIC_RUN_ID"] for s in seen}
    assert len(run_ids) == 1 and None not in run_ids and "" not in run_ids, run_ids


@pytest.mark.parametrize("launcher", ["ddpkit", "torchrun"])
def test_lightning_detects_torchelastic_and_shards_the_data(runs, launcher):
    run = runs[launcher]
    assert run.returncode == 0, run.output[-4000:]
    for s in run.ranks.values():
        assert s["cluster_environment"] == "TorchElasticEnvironment", s
        assert s["sampler"] == "DistributedSampler", s


def test_weights_are_equal_on_both_ranks_and_to_torchruns(runs):
    ddpkit_run, torchrun = runs["ddpkit"], runs["torchrun"]
    assert ddpkit_run.returncode == 0 and torchrun.returncode == 0, ddpkit_run.output[-2000:]
    reference = torchrun.weights[0]
    assert reference, "torchrun's rank 0 saved no parameters"
    for run in (ddpkit_run, torchrun):
        assert [run.ranks[r]["num_threads"] for r in (0, 1)] == [1, 1], "compared with unequal threads"
    # test_training_moved_every_weight shows these are trained weights, not the shared init.
    for name, run in (("torchrun", torchrun), ("ddpkit run", ddpkit_run)):
        for rank in (0, 1):
            state = run.weights[rank]
            assert state.keys() == reference.keys(), (name, rank, sorted(state))
            differ = [k for k in reference if not torch.equal(state[k], reference[k])]
            threads = [run.ranks[r]["num_threads"] for r in (0, 1)]
            assert not differ, (
                f"{name} rank {rank} ends with other weights than torchrun's rank 0 in {differ} "
                f"(threads per rank: {name} {threads}, torchrun "
                f"{[torchrun.ranks[r]['num_threads'] for r in (0, 1)]})"
            )


def test_training_moved_every_weight(runs):
    """Equal weights would prove nothing if no step had changed them."""
    run = runs["ddpkit"]
    assert run.returncode == 0, run.output[-4000:]
    for rank in (0, 1):
        initial = torch.load(run.out / f"initial_rank{rank}.pt", weights_only=True)
        unmoved = [k for k in initial if torch.equal(initial[k], run.weights[rank][k])]
        assert not unmoved, f"rank {rank}: {unmoved} did not change in {MAX_STEPS} steps"
