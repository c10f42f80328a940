"""ddpkit.launch: results per rank, and a failing rank stops the others and is named."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import run_ranks
from run_scripts import listening

import ddpkit
from ddpkit.errors import ConfigError


def _rank_world_and_listeners(env) -> tuple[int, int, list[str], list[str]]:
    """This rank, the world, and where the launcher (our parent) and this rank listen for TCP."""
    return env.rank, env.world_size, listening(os.getppid()), listening(os.getpid())


@pytest.mark.slow
def test_returns_each_ranks_result_and_hosts_the_store_on_loopback():
    results = run_ranks(_rank_world_and_listeners, 3, start_method=None)
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    # The launcher hosts the ranks' store on loopback alone (torch's TCPStore, opened by rank 0
    # itself, would listen on every interface, unauthenticated); rank 0 hosts no store.
    # (The test process may hold other loopback stores of earlier tests in it.)
    stores = results[0][2]
    assert stores and all(a.startswith("127.0.0.1:") for a in stores), stores
    ports = {a.rsplit(":", 1)[1] for a in stores}
    assert not any(a.rsplit(":", 1)[1] in ports for a in results[0][3]), results[0][3]


def _rank1_raises_others_wait(env) -> None:
    if env.rank == 1:
        raise ValueError("rank one cannot go on")
    # The others block in a collective that rank 1 never joins: the launcher must stop them.
    import torch.distributed as dist

    dist.barrier()


@pytest.mark.slow
def test_failing_rank_is_reported_and_others_stopped():
    start = time.monotonic()
    with pytest.raises(ddpkit.LaunchError) as info:
        run_ranks(_rank1_raises_others_wait, 3, start_method=None)
    assert info.value.rank == 1
    assert "ValueError: rank one cannot go on" in info.value.detail
    assert "Traceback" in info.value.detail
    assert time.monotonic() - start < 60  # gloo's own timeout is 30 minutes: we did not wait for it


def _rank0_killed(env) -> None:
    if env.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def test_killed_rank_is_reported_with_its_signal():
    with pytest.raises(ddpkit.LaunchError, match="rank 0 failed: killed by SIGKILL"):
        run_ranks(_rank0_killed, 2, start_method=None)


@pytest.mark.parametrize("nproc", [0, -1, "2"])
def test_nproc_must_be_positive_int(nproc):
    with pytest.raises(ConfigError, match="nproc must be a positive integer"):
        ddpkit.launch(_rank_world_and_listeners, nproc)
