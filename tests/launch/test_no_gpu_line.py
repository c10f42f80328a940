"""A script that asks for CUDA on a machine without it (the tutorials' ``cuda:{local_rank}``) is
one line under ``ddpkit run``, naming the script's call and the fix, exit code 2 (launch/no_gpu.py)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from helpers import ddpkit_cli

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")

FORMS = {
    "set_device": "torch.cuda.set_device(rank)",
    "cuda": "model.cuda()",
    "device": 'model.to(torch.device(f"cuda:{rank}"))',
}


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_each_way_of_asking_for_cuda_is_one_line(tmp_path, form):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, torch
            rank = int(os.environ.get("LOCAL_RANK", 0))
            model = torch.nn.Linear(2, 2)
            {FORMS[form]}
            """
        ),
        encoding="utf-8",
    )
    done = ddpkit_cli(
        # Two ranks once (one line for both), one for the other forms: each launch costs seconds.
        [sys.executable, "-m", "ddpkit", "run", "--nproc", "2" if form == "set_device" else "1", str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert len(said) == 1, done.stderr[-2000:]
    assert f"asks for a GPU at train.py:5 ({FORMS[form]})" in said[0] and "run.device" in said[0]
    assert "Traceback" not in done.stderr
