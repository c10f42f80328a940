"""A full disk during a save, and a checkpoint whose pickle weights_only refuses, keep the last good one."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch

from ddpkit.checkpoint import DiskFullError, resolve_resume, save_checkpoint, verify_checkpoint
from ddpkit.checkpoint.files import save_state_dict_atomic
from ddpkit.checkpoint.manifest import STATE, write_manifest


class Payload:
    """Stands for a crafted pickle: a plain torch.load would build (and could run) anything."""

    def __reduce__(self):
        return (print, ("this ran at load",))


def test_auto_resume_skips_a_checkpoint_weights_only_refuses(tmp_path, caplog, monkeypatch):
    # A Run earlier in this process (setup_logging) stops ddpkit's records at its own handler.
    monkeypatch.setattr(logging.getLogger("ddpkit"), "propagate", True)
    good = save_checkpoint(tmp_path, 1, {"w": torch.ones(2)})
    bad = save_checkpoint(tmp_path, 2, {"w": torch.ones(2)})
    torch.save({"w": Payload()}, bad / STATE)
    write_manifest(bad, 2, [STATE])  # the manifest matches what is on disk now
    assert verify_checkpoint(bad) == []
    with caplog.at_level(logging.WARNING, logger="ddpkit.checkpoint"):
        assert resolve_resume(tmp_path, "auto") == good
    assert f"checkpoint {bad} is corrupt (torch.load(weights_only=True) refuses it: " in caplog.text
    assert f"falling back to {good}" in caplog.text


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted for the test, unmounted after it, whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_named_and_the_previous_checkpoint_stays(small_disk):
    ckpts = small_disk / "checkpoints"
    first = save_checkpoint(ckpts, 1, {"w": torch.ones(1000)})
    with pytest.raises(DiskFullError) as full:
        save_checkpoint(ckpts, 2, {"w": torch.ones(400_000)})  # 1.6 MB on a 1 MiB disk
    message = str(full.value)
    assert "No space left on device writing" in message and "step-00000002" in message, message
    assert "needs about 1,600,000 bytes" in message and f"the previous checkpoint {first} is kept" in message
    assert "\n" not in message
    assert sorted(p.name for p in ckpts.iterdir()) == [first.name]  # the partial copy is gone
    assert resolve_resume(ckpts, "auto") == first


def test_a_full_disk_keeps_the_previous_model_file(small_disk):
    path = small_disk / "model.pt"
    save_state_dict_atomic({"w": torch.ones(10)}, path)
    with pytest.raises(DiskFullError, match=r"writing .*model\.pt: it needs about 1,600,000 bytes .* kept"):
        save_state_dict_atomic({"w": torch.zeros(400_000)}, path)
    assert sorted(p.name for p in small_disk.iterdir()) == ["model.pt"]
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(10))
