"""The check of ``async_save=True`` on N processes, shared by tests/run/test_run_async_save.py
(the CPU, 2 processes) and tests/gpu/test_gpu_async_save.py (cuda:0, a world of one): the run of
tests/run/async_save_script.py with background saves equals the synchronous one to the bit, and a
kill inside the background write leaves nothing that loads: the same command resumes from the
checkpoint before and ends bit-equal. A sharded save's background copy is slowed, so a step
that did not wait for it would change the weights it copies."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from helpers import ddpkit_run, logged_losses

SCRIPT = Path(__file__).with_name("async_save_script.py")
DIE_AT = 14  # of 24 steps (2 epochs of 12); the checkpoint of step 12 is the one to resume


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True, map_location="cpu")


def check_async_saves(tmp_path: Path, engine: str, nproc: int, *model: str) -> None:
    """``model``: the script's model flags (``--batchnorm``: buffers the forward changes)."""
    sync, background = tmp_path / "sync", tmp_path / "async"
    ddpkit_run(SCRIPT, sync, nproc, "--engine", engine, *model)
    ddpkit_run(SCRIPT, background, nproc, "--async-save", "--engine", engine, "--slow-staging", *model)
    assert logged_losses(background) == logged_losses(sync) and len(logged_losses(sync)) == 24
    assert all(torch.equal(_weights(background)[k], v) for k, v in _weights(sync).items())
    assert sorted(p.name for p in (background / "checkpoints").iterdir()) == [
        f"step-{step:08d}" for step in (20, 22, 24)
    ]

    killed = tmp_path / "killed"
    ddpkit_run(
        SCRIPT,
        killed,
        nproc,
        "--async-save",
        "--engine",
        engine,
        "--die-in-write",
        str(DIE_AT),
        "--slow-staging",
        *model,
        code=1,
    )
    saved = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert f"step-{DIE_AT - 2:08d}" in saved and f"step-{DIE_AT:08d}" not in saved, saved
    assert any(name.startswith(f".step-{DIE_AT:08d}.") for name in saved), saved  # written, not renamed
    rerun = tmp_path / "rerun"
    shutil.copytree(killed, rerun)
    done = ddpkit_run(SCRIPT, rerun, nproc, "--async-save", "--engine", engine, *model)
    assert (
        f"resumed from {rerun / 'checkpoints' / f'step-{DIE_AT - 2:08d}'} at step {DIE_AT - 2}" in done.stdout
    )
    assert all(torch.equal(_weights(rerun)[k], v) for k, v in _weights(sync).items())
    assert logged_losses(rerun) == logged_losses(sync)
