"""DistEnv and launcher-variable detection, without spawning: environments are built by hand."""

from __future__ import annotations

import pytest
import torch

from ddpkit.dist import DistEnv, read_launcher_vars, resolve_backend
from ddpkit.dist.env import first_slurm_host, slurm_tasks_on_node
from ddpkit.errors import ConfigError

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "2",
}
SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "6",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "3(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_JOB_ID": "4242",
}


def test_torchrun_variables_give_ranks_and_env_init():
    found = read_launcher_vars(TORCHRUN)
    assert (found.rank, found.local_rank, found.world_size, found.local_world_size, found.node_rank) == (
        5,
        1,
        8,
        4,
        1,
    )
    assert found.launcher == "elastic" and found.init_method == "env://" and found.restart_count == 2


def test_slurm_variables_give_ranks_and_tcp_init_on_first_node():
    found = read_launcher_vars(SLURM)
    assert (found.rank, found.local_rank, found.world_size, found.local_world_size, found.node_rank) == (
        3,
        0,
        6,
        3,
        1,
    )
    assert found.launcher == "slurm"
    assert found.init_method == f"tcp://gpu07:{15000 + 4242 % 20000}"


def test_torchrun_variables_win_over_slurm_when_both_are_set():
    assert read_launcher_vars({**SLURM, **TORCHRUN}).launcher == "elastic"


def test_no_launcher_is_a_world_of_one():
    found = read_launcher_vars({})
    assert (found.rank, found.world_size, found.init_method, found.launcher) == (0, 1, None, "none")


def test_bad_variable_is_named():
    with pytest.raises(ConfigError, match="WORLD_SIZE='two'"):
        read_launcher_vars({**TORCHRUN, "WORLD_SIZE": "two"})


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node01", "node01"), ("gpu[07-09]", "gpu07"), ("a[3,5-6],b1", "a3"), ("h1,h2", "h1")],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_slurm_tasks_per_node_layout():
    assert [slurm_tasks_on_node("2(x3),1", n, 7) for n in range(4)] == [2, 2, 2, 1]
    assert slurm_tasks_on_node("", 0, 5) == 5


def test_distenv_is_frozen_and_checks_ranks():
    env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)
    assert not env.is_rank0 and not env.is_local_rank0
    with pytest.raises(AttributeError):
        env.rank = 0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="rank 2 is outside world_size 2"):
        DistEnv(rank=2, world_size=2)


def test_collectives_run_on_the_gpu_under_nccl_and_on_the_cpu_otherwise():
    gpu = torch.device("cuda", 1)
    assert (
        DistEnv(local_rank=1, local_world_size=2, world_size=2, device=gpu, backend="nccl").collective_device
        == gpu
    )
    assert DistEnv(device=gpu, backend="gloo").collective_device == torch.device("cpu")
    assert DistEnv().collective_device == torch.device("cpu")


def test_backend_auto_is_gloo_without_enough_gpus():
    assert resolve_backend("auto", 2, gpu_count=0) == "gloo"
    assert resolve_backend("auto", 4, gpu_count=2) == "gloo"
    assert resolve_backend("auto", 2, gpu_count=2) == "nccl"


def test_backend_nccl_without_gpus_names_the_fix():
    with pytest.raises(ConfigError, match="2 processes on this node but 0 GPUs.*--backend gloo"):
        resolve_backend("nccl", 2, gpu_count=0)
    with pytest.raises(ConfigError, match="--nproc 1"):
        resolve_backend("nccl", 2, gpu_count=1)


def test_backend_mpi_and_unknown():
    if not torch.distributed.is_mpi_available():
        with pytest.raises(ConfigError, match="built with MPI"):
            resolve_backend("mpi", 1)
    with pytest.raises(ConfigError, match="unknown backend 'ncl'"):
        resolve_backend("ncl", 1)
