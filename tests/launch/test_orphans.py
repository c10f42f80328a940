"""No orphans: a SIGKILLed launcher takes its workers with it, while they start and mid-run.

The workers run an unmodified script (nothing of ddpkit in it), so what ends them is the
launcher's start-up code on their path (PR_SET_PDEATHSIG), and for a dead rank's DataLoader
workers torch's own check of their parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import descendants
from run_scripts import FOREVER_SCRIPT, alive, ddpkit_run, workers

pytestmark = pytest.mark.slow


def _wait_for(condition, proc: subprocess.Popen, what: str, limit: float = 90.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert proc.poll() is None, f"the launcher exited before {what}:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {limit} s"
        time.sleep(0.01)


def _seconds_until_gone(pids: set[int], limit: float) -> float:
    start = time.monotonic()
    while any(alive(p) for p in pids) and time.monotonic() - start < limit:
        time.sleep(0.05)
    return time.monotonic() - start


def _kill_all(proc: subprocess.Popen, pids: set[int]) -> None:
    for pid in pids | {proc.pid}:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.communicate()


def test_ranks_and_their_dataloader_workers_die_with_a_launcher_killed_mid_run(tmp_path, short_tmpdir):
    script, ready = tmp_path / "forever.py", tmp_path / "ready"
    script.write_text(FOREVER_SCRIPT)
    launcher = ddpkit_run("--nproc", "2", str(script), str(ready))
    family: set[int] = set()
    try:
        _wait_for(ready.exists, launcher, "training steps")
        ranks = set(workers(launcher.pid, str(script)).values())
        family = descendants(launcher.pid)
        assert len(ranks) == 2 and len(family - ranks) >= 4, "two ranks with two DataLoader workers each"
        os.kill(launcher.pid, signal.SIGKILL)
        ranks_gone = _seconds_until_gone(ranks, 10)
        all_gone = _seconds_until_gone(family, 15)
    finally:
        _kill_all(launcher, family)
    assert ranks_gone < 2, f"ranks outlived their launcher by {ranks_gone:.1f} s"
    # A DataLoader worker checks its parent every 5 s (torch's MP_STATUS_CHECK_INTERVAL).
    assert all_gone < 8, f"DataLoader workers outlived their rank by {all_gone:.1f} s"


def _kill_during_start_up(cmd: list[str], tmp_path) -> tuple[float, set[int]]:
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    family: set[int] = set()
    try:
        # The moment the agent has started both workers, long before they import torch.
        _wait_for(lambda: len(workers(launcher.pid, cmd_marker(cmd))) == 2, launcher, "two workers")
        family = descendants(launcher.pid)
        os.kill(launcher.pid, signal.SIGKILL)
        return _seconds_until_gone(family, 10), family
    finally:
        _kill_all(launcher, family)


def cmd_marker(cmd: list[str]) -> str:
    """The argument that names a worker of ``cmd`` on its command line."""
    return "ddpkit.train.worker" if "train" in cmd else cmd[-2]


def test_workers_die_with_a_launcher_killed_while_they_start(tmp_path, short_tmpdir):
    script = tmp_path / "forever.py"
    script.write_text(FOREVER_SCRIPT)
    run = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script), str(tmp_path / "ready")]
    gone, family = _kill_during_start_up(run, tmp_path)
    assert family and gone < 3, f"`ddpkit run` workers outlived their launcher by {gone:.1f} s"
    train = [sys.executable, "-m", "ddpkit", "train", "toy", "--nproc", "2", "--out", str(tmp_path / "t")]
    gone, family = _kill_during_start_up(train, tmp_path)
    assert family and gone < 3, f"`ddpkit train` workers outlived their launcher by {gone:.1f} s"
