"""Workers killed from outside: restarted from the newest checkpoint, or a prompt failure naming the rank."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ddpkit_cli, ddpkit_popen, descendants, last_step

from ddpkit.launch.restarts import EVENTS
from ddpkit.run.monitor.metrics import read_metrics
from ddpkit.train.report import summarize

pytestmark = pytest.mark.slow

RUN = [
    "toy",
    "--global-batch",
    "12",
    "--log-every",
    "1",
    "--seed",
    "5",
    "--micro-batch",
    "1",
    "--steps",
    "60",
    "--save-every",
    "5",
    "--nproc",
    "2",
]


def _start(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ddpkit", "train", *RUN, "--out", str(out), *extra]
    return ddpkit_popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _workers(launcher: int) -> list[int]:
    found = []
    for pid in descendants(launcher):
        try:
            if b"ddpkit.train.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def _kill_a_worker_after(proc: subprocess.Popen, out: Path, step: int) -> int:
    deadline = time.monotonic() + 120
    while last_step(out) < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    victims = _workers(proc.pid)
    assert victims, "no worker to kill"
    victim = random.Random(step).choice(victims)
    Path(f"/proc/{victim}").exists() and __import__("os").kill(victim, signal.SIGKILL)
    return last_step(out)


def test_killed_workers_restart_and_finish_bit_identical(tmp_path):
    whole = ddpkit_cli(
        [sys.executable, "-m", "ddpkit", "train", *RUN, "--out", str(tmp_path / "whole")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert whole.returncode == 0, whole.stderr[-2000:]
    proc = _start(tmp_path / "cut", "--max-restarts", "3")
    first = _kill_a_worker_after(proc, tmp_path / "cut", 12)
    second = _kill_a_worker_after(proc, tmp_path / "cut", first + 14)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert first < second < 60, (first, second)
    assert out.count("resumed from") >= 2  # one per kill (a restart that itself fails adds one)
    # One line per restart, naming the step the Run then resumed from; the same in events.jsonl
    # and in `ddpkit report`'s summary.
    said = [line for line in err.splitlines() if line.startswith("ddpkit: restart")]
    resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", out)]
    named = [int(re.search(r"the workers resume from step (\d+) \(", line).group(1)) for line in said]
    assert len(said) >= 2 and named == resumed, (said, resumed)
    assert all(" of 3: local rank " in line and "killed by signal SIGKILL" in line for line in said[:2]), said
    events = read_metrics(tmp_path / "cut" / EVENTS)
    assert [(e["restart"], e["step"]) for e in events] == list(enumerate(named, 1)), events
    summary = summarize(read_metrics(tmp_path / "cut" / "metrics.jsonl"), None, events)
    restarts = [line for line in summary if line.startswith("restart ")]
    assert len(restarts) == len(named), summary
    assert restarts[0].startswith("restart        1 of 3: local rank "), restarts
    assert restarts[0].endswith(f"; resumed from step {named[0]}"), restarts
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_without_restarts_a_killed_worker_ends_the_run_promptly(tmp_path):
    proc = _start(tmp_path / "run")
    _kill_a_worker_after(proc, tmp_path / "run", 5)
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1
    assert "failed (exit code -9): killed by signal SIGKILL" in err
    assert not _workers(proc.pid)
