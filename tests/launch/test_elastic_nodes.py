"""Elastic world size: a node leaves an `--nnodes 1:2` c10d job and the rest finish it, nothing lost.

Two `ddpkit train` processes on this machine are the two nodes (one worker each). The second is
SIGKILLed mid-epoch (its worker dies with it); the first re-forms the rendezvous alone, resumes
from the newest checkpoint in the shared --out and finishes the epoch on one worker with the
same global batch of 12.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch
from helpers import ddpkit_cli, ddpkit_popen, last_step

from ddpkit.launch.ports import free_port

pytestmark = pytest.mark.slow

EPOCH_SAMPLES = 3686  # the toy's training split; 308 steps of 12, the last one of 2
RUN = "toy --global-batch 12 --epochs 1 --log-every 1 --save-every 10 --log-samples --micro-batch 1 --seed 3"
# last_call_timeout: how long a round stays open for more nodes once the minimum (1) is there; the
# first round closes at once when both nodes are in, the round after the kill waits it out.
# keep_alive_*: the killed node counts as gone after ~4 s without heartbeats (torch: 15 s); much
# shorter and a live node's late heartbeat on this busy machine could be taken for a death.
RDZV_CONF = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=4,join_timeout=60"
DDPKIT = [sys.executable, "-m", "ddpkit", "train"]


def _node(out, port: int, conf: str, *extra: str) -> subprocess.Popen:
    launch = f"--nnodes 1:2 --nproc 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id elastic"
    cmd = [*DDPKIT, *RUN.split(), "--out", str(out), *launch.split(), "--max-restarts", "3"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "start_new_session": True}
    return ddpkit_popen([*cmd, "--rdzv-conf", conf, *extra], **pipes)


def _wait(condition, proc: subprocess.Popen, what: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert proc.poll() is None, f"the first node exited before {what}:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {limit} s"
        time.sleep(0.005)


def _steps(out) -> dict[int, dict[str, list[int]]]:
    """step -> {rank file: the dataset indices it logged for that step}."""
    steps: dict[int, dict[str, list[int]]] = defaultdict(dict)
    for path in sorted((out / "samples").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps[record["step"]][path.stem] = record["indices"]
    return steps


def test_a_node_leaves_and_the_rest_finish_the_epoch(tmp_path):
    whole_cmd = [*DDPKIT, *RUN.split(), "--nproc", "2", "--out", str(tmp_path / "whole")]
    whole = ddpkit_cli(whole_cmd, capture_output=True, text=True, timeout=240)
    assert whole.returncode == 0, whole.stderr[-3000:]

    out, port = tmp_path / "elastic", free_port()
    # Both nodes start at once, so the second joins the first round within its last_call_timeout
    # however slowly processes start on this machine (started once the first node listened, it
    # had to start up within those 10 s). The first node hosts the c10d store and must be the one
    # that stays (the store dies with its host): is_host=0 keeps the second from hosting it, and it
    # waits for the first one's. --node-rank 1 only stops `ddpkit train` on the second node from
    # preparing the shared --out a second time; c10d itself ignores it.
    first = _node(out, port, RDZV_CONF)
    second = _node(out, port, f"{RDZV_CONF},is_host=0", "--node-rank", "1")
    try:
        _wait(lambda: last_step(out) >= 25, first, "step 25", limit=120)  # start-up included
        os.kill(second.pid, signal.SIGKILL)  # its worker follows (PR_SET_PDEATHSIG)
        killed_at = last_step(out)
        stdout, stderr = first.communicate(timeout=120)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            if proc is not None:
                proc.communicate()
    assert first.returncode == 0, stderr[-3000:]
    assert killed_at < 300, f"the run was nearly over (step {killed_at}) when the node left"
    assert "resumed from" in stdout and "on 1 processes" in stdout, stdout[-2000:]

    steps = _steps(out)
    assert sorted(steps) == list(range(1, 309))
    two = [s for s in steps if set(steps[s]) == {"rank0", "rank1"}]
    one = [s for s in steps if set(steps[s]) == {"rank0"}]
    assert two and one and two == list(range(1, len(two) + 1)) and len(two) + len(one) == 308, (two, one)
    # Same global batch on 2 workers and on 1: 12 samples a step (the epoch's last step has 2).
    for step, by_rank in steps.items():
        assert sum(map(len, by_rank.values())) == (12 if step < 308 else 2), (step, by_rank)
    taken = [i for by_rank in steps.values() for indices in by_rank.values() for i in indices]
    assert sorted(taken) == list(range(EPOCH_SAMPLES)), "every sample of the epoch exactly once"

    # Numerically the run is the uninterrupted 2-worker one, up to the summation order of 12
    # samples on 1 worker versus 6 + 6 on 2 (the trainer issue's tolerance for a resize).
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(out / "model.pt", weights_only=True)
    for name in a:
        assert torch.allclose(b[name], a[name], rtol=1e-5, atol=1e-7), name
