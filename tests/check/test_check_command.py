"""``ddpkit check`` on a user's script (tests/check/check_script.py), as a user runs it: a plain
loop is the same run on 1, 2 and 3 processes (exit 0); one with BatchNorm is not, from step 1,
and the line rank 0 said names BatchNorm (exit 1). The script's own out= is left untouched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("check_script.py")


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ddpkit", "check", "--steps", "2", *args]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_a_plain_loop_is_the_same_run_on_1_2_and_3_processes(tmp_path):
    done = _check(tmp_path, "--nproc", "1,2,3", str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the same run on 1, 2, 3 processes" in done.stdout, done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"]  # one row a step
    gaps = [float(x) for row in rows for x in row[2:]]
    assert max(gaps) <= 1e-6, done.stdout
    assert not (tmp_path / "runs").exists()  # the script's out= is the check's scratch folder


def test_batchnorm_is_not_the_same_run_and_the_cause_is_named(tmp_path):
    done = _check(tmp_path, "--nproc", "1,2", str(SCRIPT), "--batchnorm")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not the same run: 2 processes at step 1: loss" in done.stdout, done.stdout
    assert "the run said:" in done.stdout and "BatchNorm in training mode in 1 " in done.stdout


def test_a_failing_script_is_exit_code_2_with_its_error(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ValueError('the user script fails')\n")
    done = _check(tmp_path, "--nproc", "1", str(broken))
    assert done.returncode == 2 and "the user script fails" in done.stderr, done.stdout + done.stderr
