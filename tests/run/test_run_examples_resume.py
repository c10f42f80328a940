"""The GAN (two models, two optimizers), the dict-batch model and the iteration-based loop resume bit
for bit after a SIGKILL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ddpkit_cli
from test_run_resume import kill_job_at

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _cmd(example: str, out: Path, *extra: str) -> list[str]:
    script = str(EXAMPLES / f"{example}.py")
    return [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "--standalone",
        "--nproc",
        "2",
        script,
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.parametrize(
    ("example", "extra", "kill_after", "weights"),
    [
        ("gan", ("--save-every", "20"), 150, ("generator.pt", "discriminator.pt")),
        ("hf_style", ("--save-every", "5", "--micro-batch", "4"), 15, ("model.pt",)),
        # An lr set by hand from run.step, a budget of steps=, evaluation and the best model kept.
        (
            "iterations",
            ("--iters", "400", "--save-every", "50", "--eval-every", "50"),
            150,
            ("model.pt", "best.pt"),
        ),
    ],
)
def test_example_resumes_bit_for_bit_after_sigkill(tmp_path, example, extra, kill_after, weights):
    whole = ddpkit_cli(_cmd(example, tmp_path / "whole", *extra), capture_output=True, text=True, timeout=240)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed_at = kill_job_at(_cmd(example, tmp_path / "cut", *extra), tmp_path / "cut", kill_after)
    assert not (tmp_path / "cut" / weights[0]).exists(), (
        f"the run finished before the kill (step {killed_at})"
    )
    resumed = ddpkit_cli(_cmd(example, tmp_path / "cut", *extra), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    for name in weights:
        a, b = (torch.load(tmp_path / run / name, weights_only=True) for run in ("whole", "cut"))
        assert all(torch.equal(a[k], b[k]) for k in a), f"{name} differs after the resume"


def test_the_documented_own_script_runs_on_two_processes_and_resumes(tmp_path):
    docs = Path(__file__).resolve().parents[2] / "docs" / "own-script"
    lines = [
        line
        for line in subprocess.run(
            ["diff", docs / "single_gpu.py", docs / "ddpkit_run.py"], capture_output=True, text=True
        ).stdout.splitlines()
        if line.startswith(">")
    ]
    assert len(lines) <= 10, f"docs/own-script.md promises 10 changed lines, the diff has {len(lines)}"
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "--standalone",
        "--nproc",
        "2",
        str(docs / "ddpkit_run.py"),
    ]
    first = ddpkit_cli([*command, "1", "1", "64"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    again = ddpkit_cli([*command, "2", "1", "64"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "step-00000032" in again.stdout  # epoch 1 of 2048 / 64
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "runs/own-script/metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == 64 and steps == sorted(set(steps)), steps
