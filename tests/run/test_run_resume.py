"""A user's own loop on ddpkit.Run (examples/own_loop.py) under `ddpkit run`: killed, restarted, resized.

The example has dropout and a random augmentation in its dataset, so a resume is bit-exact only
if every generator (the training process's and the DataLoader workers') continues where it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    ddpkit_cli,
    ddpkit_popen,
    descendants,
    last_step,
    logged_losses,
    saved_weights,
    wait_unlocked,
)

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _cmd(out: Path, nproc: int, *extra: str, launch: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "ddpkit", "run", "--standalone", "--nproc", str(nproc), *launch,
        str(EXAMPLES / "own_loop.py"), "--out", str(out), *extra,
    ]  # fmt: skip


def _run(out: Path, nproc: int, *extra: str, launch: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    done = ddpkit_cli(_cmd(out, nproc, *extra, launch=launch), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int) -> int:
    deadline = time.monotonic() + 120
    while last_step(out) < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, (
        f"the run ended (exit {proc.returncode}) at step {last_step(out)}, before {step}"
    )
    return last_step(out)


def kill_job_at(cmd: list[str], out: Path, step: int) -> int:
    """Start ``cmd``, SIGKILL its launcher and every worker once ``step`` is logged; the last step logged."""
    proc = ddpkit_popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    killed_at = _wait_for_step(proc, out, step)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_unlocked(out), f"a process of the killed job still holds {out}"
    return killed_at


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# 3 epochs of 20 steps of 32 samples; micro-batches of 2 make a step slow enough to be cut mid-epoch.
SLOW = ["--micro-batch", "2", "--size", "640", "--save-every", "10"]


def _kill_job_at(out: Path, step: int, *run: str) -> int:
    killed_at = kill_job_at(_cmd(out, 2, *run), out, step)
    assert step <= killed_at < 60, f"the run was not cut mid-way (last logged step {killed_at})"
    return killed_at


def test_sigkill_of_the_whole_job_then_resume_is_bit_identical(tmp_path):
    _run(tmp_path / "whole", 2, *SLOW)
    _kill_job_at(tmp_path / "cut", 25, *SLOW)  # mid-epoch 2
    done = _run(tmp_path / "cut", 2, *SLOW)  # resume="auto" is the default
    assert "resumed from" in done.stdout
    assert _same(saved_weights(tmp_path / "whole"), saved_weights(tmp_path / "cut")), "resumed model differs"
    assert logged_losses(tmp_path / "cut") == logged_losses(tmp_path / "whole")


def _ranks(launcher: int) -> list[int]:
    """The launcher's own children running the script: the ranks (DataLoader workers are theirs)."""
    found = []
    for pid in descendants(launcher):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == launcher and b"own_loop.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except (OSError, ValueError):
            pass
    return sorted(found)


def _consumed(out: Path) -> list[int]:
    taken = []
    for path in (out / "samples").glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            taken += json.loads(line)["indices"]
    return taken


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_resume_at_another_world_size_uses_every_sample_once(tmp_path, before, after):
    # One epoch of 1000 samples in global batches of 32: 31 full steps and a last one of 8.
    epoch = ["--micro-batch", "2", "--size", "1000", "--epochs", "1", "--save-every", "5", "--log-samples"]
    out = tmp_path / "run"
    assert kill_job_at(_cmd(out, before, *epoch), out, 12) < 32
    _run(out, after, *epoch)
    taken = _consumed(out)
    assert sorted(taken) == list(range(1000)), "an epoch must use every sample exactly once"


def test_sigterm_checkpoints_the_agreed_step_and_the_resumed_run_is_bit_identical(tmp_path):
    run = ["--micro-batch", "2", "--size", "1280"]  # 120 steps; no --save-every: the signal saves
    _run(tmp_path / "whole", 2, *run)
    out = tmp_path / "cut"
    proc = ddpkit_popen(_cmd(out, 2, *run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    signalled_at = _wait_for_step(proc, out, 20)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 30, "the run did not end within the grace period"
    assert "ddpkit: preempted by SIGTERM at step" in stdout, f"{stdout[-2000:]}\n{stderr[-3000:]}"
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(saved) == 1 and int(saved[0].split("-")[1]) > signalled_at
    done = _run(out, 2, *run)
    assert f"resumed from {out / 'checkpoints' / saved[0]}" in done.stdout
    assert _same(saved_weights(tmp_path / "whole"), saved_weights(out)), (
        "the run resumed after SIGTERM differs"
    )
