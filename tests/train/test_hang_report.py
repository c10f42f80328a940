"""A worker frozen with SIGSTOP mid-run: `ddpkit train` names it, shows the others' stacks, and ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import last_step as _last_step
from test_restarts import _workers

pytestmark = pytest.mark.slow


def test_frozen_worker_is_reported_and_the_run_ends(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        "toy",
        "--nproc",
        "2",
        "--steps",
        "100000",
        "--log-every",
        "1",
        "--global-batch",
        "8",
        "--collective-timeout",
        "3",
        "--grace-period",  # a SIGSTOPped worker ignores SIGTERM: it is killed after this
        "3",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # start-up takes a minute at a load average of 20
    while _last_step(out) < 20 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # Frozen before it trains, a worker would be reported by the launcher, not by rank 0's watchdog.
    assert _last_step(out) >= 20, f"no step 20 to freeze at:\n{proc.communicate()[1][-3000:]}"
    frozen = max(_workers(proc.pid))  # the newest worker: local rank 1
    os.kill(frozen, signal.SIGSTOP)
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    # The timeout, the answers' wait (4 s) and the 3 s grace, not torch's fixed 30 s after a failure.
    assert time.monotonic() - start < 25
    assert (out / "hang-report.txt").exists(), err[-3000:]
    report = (out / "hang-report.txt").read_text()
    assert "rank 1" in report and "no answer" in report
    assert "stack of rank 0" in report
    assert "a collective did not complete in time" in err
    assert not _workers(proc.pid)
