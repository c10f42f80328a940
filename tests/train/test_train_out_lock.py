"""One run per --out: a second run, a second resume or an --overwrite of a running job fails at once."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from helpers import ddpkit_cli, ddpkit_popen

pytestmark = pytest.mark.slow

TOY = [
    "toy",
    "--nproc",
    "2",
    "--global-batch",
    "12",
    "--micro-batch",
    "1",
    "--steps",
    "100000",
    "--log-every",
    "100",
]


def _train(out, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ddpkit", "train", *TOY, "--out", str(out), *extra]


def test_a_running_folder_cannot_be_trained_into_resumed_or_overwritten(tmp_path):
    out = tmp_path / "run"
    first = ddpkit_popen(_train(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before the test could race it"
        for extra in (["--resume", "auto"], ["--overwrite"]):
            second = ddpkit_cli(_train(out, *extra), capture_output=True, text=True, timeout=120)
            lines = second.stderr.strip().splitlines()
            assert second.returncode == 2, second.stderr[-2000:]
            assert len(lines) == 1 and "is in use by a running ddpkit run (pid" in lines[0], lines
        assert (out / "metrics.jsonl").exists(), "--overwrite deleted a running job's folder"
    finally:
        first.kill()
        first.wait()
    # The killed run's lock went with it: the folder can be taken over.
    done = ddpkit_cli(_train(out, "--overwrite", "--steps", "3"), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
