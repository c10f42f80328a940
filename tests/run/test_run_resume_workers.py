"""examples/own_loop.py with DataLoader workers under `ddpkit run`: a killed job and a killed rank
(under --max-restarts) both resume bit for bit; the rank's workers die with it.

Apart from tests/run/test_run_resume.py so that the suite's two workers can share the load.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
from helpers import saved_weights
from test_run_resume import SLOW, _cmd, _kill_job_at, _ranks, _run, _same, _wait_for_step

pytestmark = pytest.mark.slow


def test_with_dataloader_workers_a_killed_job_and_a_killed_rank_both_resume_bit_identical(tmp_path):
    run = [*SLOW, "--num-workers", "2"]
    _run(tmp_path / "whole", 2, *run)
    _kill_job_at(tmp_path / "cut", 25, *run)
    assert "resumed from" in _run(tmp_path / "cut", 2, *run).stdout
    assert _same(saved_weights(tmp_path / "whole"), saved_weights(tmp_path / "cut")), "resumed model differs"

    out = tmp_path / "restarted"
    proc = subprocess.Popen(
        _cmd(out, 2, *run, launch=("--max-restarts", "1")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_step(proc, out, 15)
    os.kill(_ranks(proc.pid)[0], signal.SIGKILL)  # its DataLoader workers must die with it
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    step = re.search(r"resumed from \S+ at step (\d+)", stdout).group(1)
    said = [line for line in stderr.splitlines() if line.startswith("ddpkit: restart")]
    assert len(said) == 1 and "restart 1 of 1: local rank 0 " in said[0], stderr[-3000:]
    assert f"; the workers resume from step {step} ({out.resolve()}/checkpoints/step-" in said[0], said
    assert _same(saved_weights(tmp_path / "whole"), saved_weights(out)), "the restarted run's model differs"
