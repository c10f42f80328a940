"""``async_save=True``: the same run as synchronous saves, to the bit, and a kill inside the
background write leaves nothing that loads: the same command resumes from the checkpoint before
and ends bit-equal, on the torch engine and on fsdp. The script is tests/run/async_save_script.py,
under `ddpkit run` on 2 processes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import ddpkit_run, logged_losses

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("async_save_script.py")
DIE_AT = 14  # of 24 steps (2 epochs of 12); the checkpoint of step 12 is the one to resume


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


@pytest.mark.parametrize("engine", ["torch", "fsdp"])
def test_async_saves_change_nothing_and_a_kill_in_the_write_resumes_bit_equal(tmp_path, engine):
    # torch: rank 0 writes state.pt in its thread. fsdp: every rank's thread writes its shards
    # through DCP's async_save, rank 0's commits the folder once all digests are in.
    sync, background = tmp_path / "sync", tmp_path / "async"
    ddpkit_run(SCRIPT, sync, 2, "--engine", engine)
    ddpkit_run(SCRIPT, background, 2, "--async-save", "--engine", engine)
    assert logged_losses(background) == logged_losses(sync) and len(logged_losses(sync)) == 24
    assert all(torch.equal(_weights(background)[k], v) for k, v in _weights(sync).items())
    assert sorted(p.name for p in (background / "checkpoints").iterdir()) == [
        f"step-{step:08d}" for step in (20, 22, 24)
    ]

    killed = tmp_path / "killed"
    ddpkit_run(SCRIPT, killed, 2, "--async-save", "--engine", engine, "--die-in-write", str(DIE_AT), code=1)
    saved = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert f"step-{DIE_AT - 2:08d}" in saved and f"step-{DIE_AT:08d}" not in saved, saved
    assert any(name.startswith(f".step-{DIE_AT:08d}.") for name in saved), saved  # written, not renamed
    rerun = tmp_path / "rerun"
    shutil.copytree(killed, rerun)
    done = ddpkit_run(SCRIPT, rerun, 2, "--async-save", "--engine", engine)
    assert (
        f"resumed from {rerun / 'checkpoints' / f'step-{DIE_AT - 2:08d}'} at step {DIE_AT - 2}" in done.stdout
    )
    assert all(torch.equal(_weights(rerun)[k], v) for k, v in _weights(sync).items())
    assert logged_losses(rerun) == logged_losses(sync)
