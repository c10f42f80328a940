"""A process whose gloo group outlives destroy_process_group waits for its worker threads at exit.

torch.profiler keeps every process group that existed while it ran; such a group's gloo worker
threads live on into interpreter shutdown, where a collective's late tensor drop aborts the
process (SIGABRT, seen once in ~70 engine-bench runs). ``release_process_groups`` finds those
threads by torch's thread name; this test fails if torch renames them or frees such groups.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import os, torch, torch.distributed as dist
from ddpkit.dist import gloo_threads, init as dist_init
from ddpkit.launch import free_port
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
for profile in (False, True):
    os.environ["MASTER_PORT"] = str(free_port())
    dist_init.init_distributed("gloo")
    dist.all_reduce(torch.ones(3))  # gloo starts its worker threads at the first collective
    alive = len(gloo_threads.gloo_worker_threads())
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            dist.all_reduce(torch.ones(3))
    dist_init.destroy()
    print(alive, len(gloo_threads.gloo_worker_threads()))
"""


@pytest.mark.slow
def test_gloo_threads_are_seen_while_a_group_lives():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (alive, after), (alive_profiled, after_profiled) = [
        map(int, line.split()) for line in done.stdout.split("\n")[-3:-1]
    ]
    assert alive >= 1, "no pt_gloo_runloop thread seen: torch renamed gloo's threads"
    assert after == 0, "a group freed by destroy_process_group keeps no worker thread"
    assert alive_profiled >= 1 and after_profiled >= 1, "the profiler's group lives on"
