"""engine="fsdp" on a GPU: a world of one over NCCL on cuda:0 (tests/run/fsdp_script.py under
``ddpkit run --nproc 1``) against torch's DDP on the same batches.

Two ranks sharing cuda:0 cannot check it: NCCL refuses two ranks on one GPU, and over gloo FSDP2's
step killed rank 0 with SIGSEGV (H100, torch 2.11; gloo has no CUDA reduce-scatter of its own).
The multi-rank checks run on the CPU over gloo (tests/run/test_run_fsdp.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import logged_losses, saved_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCRIPT = Path(__file__).parents[1] / "run" / "fsdp_script.py"
STEPS, MICRO, RTOL = 4, 2, 1e-5


def _run(out: Path, *extra: str, code: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "1", str(SCRIPT), "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == code, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def test_a_world_of_one_on_nccl_equals_ddp_and_resumes_bit_equal_after_a_kill_inside_its_save(tmp_path):
    _run(tmp_path / "torch", "--engine", "torch", "--micro-batch", "2")
    _run(tmp_path / "fsdp", "--micro-batch", "2")
    assert logged_losses(tmp_path / "fsdp") == pytest.approx(logged_losses(tmp_path / "torch"), rel=1e-5)
    for key, value in saved_weights(tmp_path / "torch").items():
        torch.testing.assert_close(
            saved_weights(tmp_path / "fsdp")[key], value, rtol=1e-5, atol=1e-6, msg=key
        )
    cut = tmp_path / "cut"
    _run(cut, "--micro-batch", "2", "--kill-in-save", "8", code=1)
    assert "resumed from" in _run(cut, "--micro-batch", "2").stdout
    assert all(torch.equal(saved_weights(cut)[k], v) for k, v in saved_weights(tmp_path / "fsdp").items())
