"""``ddpkit check`` on a user's script, as a user runs it: a plain loop (tests/check/check_script.py)
and examples/own_loop.py are the same run (exit 0); the script with BatchNorm, with an nn.Dropout
the run does not key, or with a Mixup over the micro-batch is not, and the check names the habit
whose switching off closes the gap, with its fix (exit 1). The script's own out= is left untouched,
and the noise floor is measured (non-zero where the thread count changes a sum)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ddpkit_cli

import ddpkit.check

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("check_script.py")
EXAMPLE = Path(__file__).parents[2] / "examples" / "own_loop.py"


def _check(tmp_path: Path, *args: str, steps: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ddpkit", "check", "--steps", str(steps), *args]
    return ddpkit_cli(command, cwd=tmp_path, capture_output=True, text=True, timeout=400)


def _gaps(stdout: str) -> list[float]:
    rows = [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit()]
    return [float(x) for row in rows for x in row[2:] if x != "!"]


def test_a_plain_loop_is_the_same_run_on_1_2_and_3_processes(tmp_path):
    done = _check(tmp_path, "--nproc", "1,2,3", str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the same run on 1, 2, 3 processes" in done.stdout, done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"]  # one row a step
    assert max(_gaps(done.stdout)) <= 1e-6, done.stdout
    assert not (tmp_path / "runs").exists()  # the script's out= is the check's scratch folder


def test_the_own_loop_example_is_the_same_run(tmp_path):
    done = _check(tmp_path, str(EXAMPLE), "--out", "runs/own")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the same run on 1, 2 processes" in done.stdout, done.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("flag", "cause"),
    [
        ("--batchnorm", "the cause: BatchNorm in training mode"),
        ("--dropout", "the cause: dropout drawn by each rank from its own generator"),
        ("--mixup", "the cause: draws from the global generators in the loop body"),
    ],
)
def test_a_habit_that_breaks_the_run_is_named_by_switching_it_off(tmp_path, flag, cause):
    done = _check(tmp_path, "--nproc", "1,2", str(SCRIPT), flag, steps=1)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not the same run: 2 processes at step 1" in done.stdout, done.stdout
    causes = [line for line in done.stdout.splitlines() if "the cause:" in line]
    assert len(causes) == 1 and cause in causes[0] and "Fix: " in causes[0], done.stdout
    left = float(re.search(r"switched off, the gap is (\d\.\de[+-]\d+)", causes[0]).group(1))
    assert left <= 1e-6, causes[0]


def test_the_floor_is_measured_not_assumed(tmp_path, monkeypatch):
    # One process with 1 thread against its default (2 here): a sum over a million weights is cut
    # into other partial sums, so the floor is not zero; the library call, as a test would use it.
    monkeypatch.chdir(tmp_path)
    if torch.get_num_threads() < 2:
        pytest.skip("one CPU thread: no other cut of the sums to measure")
    report = ddpkit.check.compare(SCRIPT, ["--penalty"], nprocs=(1,), steps=1, floor="threads")
    assert report.same and report.floor.startswith("1 process with 1 CPU thread"), report
    assert max(report.rows[0].floor) > 0, report.rows
    # A GPU's floor, cut as the processes cut the batch (micro-batches of 6 here), on the CPU.
    report = ddpkit.check.compare(SCRIPT, [], nprocs=(1, 2), steps=1, floor="micro")
    assert report.same and report.floor == "1 process, its batch cut as 2 processes cut it", report
    assert report.rows[0].floor is not None and report.rows[0].gaps, report.rows


def test_a_failing_script_is_exit_code_2_with_its_error(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ValueError('the user script fails')\n")
    done = _check(tmp_path, "--nproc", "1", str(broken))
    assert done.returncode == 2 and "the user script fails" in done.stderr, done.stdout + done.stderr
