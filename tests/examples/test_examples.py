"""Every program in examples/ runs under ``ddpkit run --nproc 2`` and passes its own checks.

The examples assert their own results (collectives against closed forms, DDP against one process
on the full batch, checkpoints against the saved weights, training against an accuracy or loss
bar) and exit non-zero when one fails, so exit code 0 is the whole test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import ddpkit_cli

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))
EXPECTED = {
    "collectives",
    "ddp_basic",
    "ddp_checkpoint",
    "ddp_model_parallel",
    "mingpt",
    "mnist_convnet",
    "own_loop",
    "hf_style",
    "gan",
}


def test_every_seed_program_has_an_example():
    assert EXPECTED <= {path.stem for path in EXAMPLES}


# tests/run runs these to the end (their self-checks included), killed and resumed; task_mlp is
# a task file for `ddpkit train`, run by tests/train/test_task_files.py.
RUN_ELSEWHERE = {"own_loop", "hf_style", "gan", "task_mlp", "iterations"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "example", [path for path in EXAMPLES if path.stem not in RUN_ELSEWHERE], ids=lambda path: path.stem
)
def test_example_runs_on_two_processes_and_checks_itself(example):
    # --standalone rendezvous on a free port: tests running side by side never collide on 29500.
    command = [sys.executable, "-m", "ddpkit", "run", "--standalone", "--nproc", "2", str(example)]
    done = ddpkit_cli(command, capture_output=True, text=True, timeout=240)
    output = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"{example.name} failed (exit {done.returncode}):\n{output}"
    assert example.stem in done.stdout, f"{example.name} printed no summary line:\n{output}"
