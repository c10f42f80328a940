"""bf16 and fp16 (GradScaler) runs on one GPU under ``ddpkit run --nproc 1``, SIGKILLed mid-epoch
and rerun: the rerun resumes from the last checkpoint and ends bit-equal to the uninterrupted run,
its losses, weights, GradScaler state and CUDA generator included (tests/gpu/gpu_amp_script.py).

Killed after step 7, the rerun resumes from step 6 (save_every=2), in epoch 1 of 3. The fp16 run
overflows at step 3, before that checkpoint, so its scale there is 32768, not the initial 65536.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import logged_losses, saved_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCRIPT = Path(__file__).with_name("gpu_amp_script.py")
STEPS, KILL_AT = 12, 7


def _run(out: Path, precision: str, *extra: str, code: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "1", str(SCRIPT), "--out", str(out)]
    # cuBLAS is bit-reproducible only with a fixed workspace; set for the child alone.
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    done = subprocess.run(
        [*cmd, "--precision", precision, *extra], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == code, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def _end(out: Path) -> dict:
    return json.loads((out / "end_state.json").read_text())


@pytest.mark.parametrize(("precision", "overflow_at"), [("bf16", 0), ("fp16", 3)])
def test_a_killed_run_resumes_bit_equal_with_its_cuda_generator(tmp_path, precision, overflow_at):
    flags = ("--overflow-at", str(overflow_at))
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _run(whole, precision, *flags)
    _run(cut, precision, *flags, "--kill-at", str(KILL_AT), code=1)
    assert not (cut / "model.pt").exists(), "the killed run finished"
    done = _run(cut, precision, *flags)
    assert "resumed from" in done.stdout and "step-00000006" in done.stdout, done.stdout[-2000:]

    assert _end(whole)["device"] == "cuda:0"
    assert len(logged_losses(whole)) == STEPS
    assert logged_losses(cut) == logged_losses(whole)
    expected = saved_weights(whole)
    assert expected.keys() == saved_weights(cut).keys()
    for key, value in expected.items():
        got = saved_weights(cut)[key]
        assert torch.equal(got, value), f"{key} differs by {(got - value).abs().max()}"
    if precision == "fp16":
        assert _end(whole)["scaler"]["scale"] == 2.0**15, "the overflow at step 3 did not halve the scale"
    # The GradScaler's scale and growth tracker, as if the run had never stopped.
    assert _end(cut)["scaler"] == _end(whole)["scaler"], "the GradScaler's state was not resumed"
    # Dropout drew from the CUDA generator every step; restored at step 6, it ends where the
    # uninterrupted run's does (a fresh generator would be 6 steps of draws behind).
    assert _end(cut)["cuda_rng"] == _end(whole)["cuda_rng"], "the CUDA generator was not resumed"
