"""Checkpoint store: atomic save, verified load, fallback from corrupt checkpoints, retention, --resume."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401 - see below
import xxhash
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

import ddpkit
from ddpkit.checkpoint import (
    CheckpointError,
    capture_rng,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    resolve_resume,
    save_checkpoint,
    store,
    verify_checkpoint,
)
from ddpkit.checkpoint.files import exchange
from ddpkit.errors import ConfigError

# AdamW's first step imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR; importing it above,
# at collection, keeps the conftest's per-test environment check from blaming the first test here.


def make_training(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    return model, optimizer, scheduler


def train_step(model: nn.Module, optimizer, scheduler, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))  # (B, in_features)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
    scheduler.step()


def make_state(step: int = 3, seed: int = 0) -> dict:
    """A state like the Trainer's: AdamW has moments and a step count after one real step."""
    model, optimizer, scheduler = make_training(seed)
    train_step(model, optimizer, scheduler, seed)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": torch.amp.GradScaler("cpu").state_dict(),
        "sampler": {"epoch": 1, "consumed": 96},
        "step": step,
        "rng": [capture_rng(), capture_rng()],
    }


def assert_same(a, b, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def truncate(path: Path) -> None:
    data = (path / "state.pt").read_bytes()
    (path / "state.pt").write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    data = bytearray((path / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "state.pt").write_bytes(bytes(data))


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_round_trip_of_a_training_state(tmp_path):
    state = make_state(step=7)
    path = save_checkpoint(tmp_path / "ckpt", 7, state)
    assert path == tmp_path / "ckpt" / "step-00000007"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.pt"]
    loaded = load_checkpoint(path)
    assert_same(state, loaded)
    assert all(t.device.type == "cpu" for t in loaded["model"].values())


def test_manifest_describes_the_files(tmp_path):
    path = save_checkpoint(tmp_path, 12, make_state())
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "state.pt").read_bytes()
    assert manifest["format"] == 1 and manifest["step"] == 12
    assert manifest["ddpkit_version"] == ddpkit.__version__
    assert datetime.fromisoformat(manifest["created"]).tzinfo is not None
    assert manifest["files"] == {
        "state.pt": {"xxh3_128": xxhash.xxh3_128(data).hexdigest(), "bytes": len(data)}
    }
    assert verify_checkpoint(path) == []


def test_a_checkpoint_with_the_earlier_sha256_manifest_still_verifies_and_loads(tmp_path):
    # Checkpoints written before the switch to xxh3_128 list sha256 digests: the same check.
    state = make_state()
    path = save_checkpoint(tmp_path, 3, state)
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == []
    assert_same(state, load_checkpoint(path))
    flip_byte(path)
    assert verify_checkpoint(path) == ["sha256 mismatch in state.pt"]


def test_loaded_state_continues_training_identically(tmp_path):
    model, optimizer, scheduler = make_training()
    train_step(model, optimizer, scheduler, seed=1)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
    }
    loaded = load_checkpoint(save_checkpoint(tmp_path, 1, state))
    model2, optimizer2, scheduler2 = make_training(seed=5)  # different init: the load must overwrite it
    model2.load_state_dict(loaded["model"])
    optimizer2.load_state_dict(loaded["optimizer"])
    scheduler2.load_state_dict(loaded["scheduler"])
    train_step(model, optimizer, scheduler, seed=2)
    train_step(model2, optimizer2, scheduler2, seed=2)
    assert_same(model.state_dict(), model2.state_dict())
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()


def test_map_location_is_honoured(tmp_path):
    path = save_checkpoint(tmp_path, 1, make_state())
    loaded = load_checkpoint(path, map_location="meta")
    assert {t.device.type for t in loaded["model"].values()} == {"meta"}
    _, latest = load_latest(tmp_path, map_location=torch.device("meta"))
    assert latest["optimizer"]["state"][0]["exp_avg"].device.type == "meta"


@pytest.mark.parametrize(
    ("corrupt", "expected"),
    [
        (truncate, "size mismatch in state.pt"),
        (flip_byte, "xxh3_128 mismatch in state.pt"),
        (lambda p: (p / "state.pt").unlink(), "missing state.pt"),
        (lambda p: (p / "manifest.json").unlink(), "missing manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{not json"), "unreadable manifest.json"),
        (lambda p: (p / "manifest.json").write_text('{"format": 1, "files": {"../x": {}}}'), "unreadable"),
    ],
)
def test_verify_reports_damage(tmp_path, corrupt, expected):
    path = save_checkpoint(tmp_path, 1, make_state())
    corrupt(path)
    problems = verify_checkpoint(path)
    assert len(problems) == 1 and problems[0].startswith(expected), problems
    with pytest.raises(CheckpointError, match=rf"{path}.*{expected}.*--resume"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    ("corrupt", "problem"), [(truncate, "size mismatch"), (flip_byte, "xxh3_128 mismatch")]
)
def test_load_latest_warns_and_falls_back(tmp_path, caplog, corrupt, problem):
    states = {step: make_state(step=step, seed=step) for step in (1, 2, 3)}
    paths = {step: save_checkpoint(tmp_path, step, s, keep_last=3) for step, s in states.items()}
    corrupt(paths[3])
    with caplog.at_level(logging.WARNING, logger="ddpkit.checkpoint"):
        path, loaded = load_latest(tmp_path)
    assert path == paths[2]
    assert_same(states[2], loaded)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"checkpoint {paths[3]} is corrupt ({problem} in state.pt")
    assert warnings[0].endswith(f"); falling back to {paths[2]}")


def test_every_corrupt_checkpoint_is_an_error(tmp_path):
    for step in (1, 2):
        flip_byte(save_checkpoint(tmp_path, step, make_state()))
    with pytest.raises(CheckpointError, match=r"no good checkpoint.*step-00000002 \(xxh3_128.*step-00000001"):
        load_latest(tmp_path)
    with pytest.raises(CheckpointError, match="--resume never"):
        resolve_resume(tmp_path, "auto")


def test_no_checkpoints_is_none(tmp_path):
    assert load_latest(tmp_path / "missing") is None
    assert load_latest(tmp_path) is None
    assert list_checkpoints(tmp_path / "missing") == []


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_retention_keeps_the_newest_k(tmp_path, keep_last):
    state = make_state()
    for step in (10, 20, 30, 40, 50):
        save_checkpoint(tmp_path, step, state, keep_last=keep_last)
    kept = [p.name for p in list_checkpoints(tmp_path)]
    assert kept == [f"step-{s:08d}" for s in (10, 20, 30, 40, 50)[-keep_last:]]
    assert sorted(p.name for p in tmp_path.iterdir()) == kept  # no hidden leftovers either


def test_list_sorts_by_step_and_skips_temporaries(tmp_path):
    for step in (100, 9, 1000):
        save_checkpoint(tmp_path, step, {"step": step}, keep_last=5)
    (tmp_path / ".step-00002000.abcd0123.tmp").mkdir()
    (tmp_path / "notes").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000009", "step-00000100", "step-00001000"]


def test_saving_an_older_step_keeps_it_and_warns(tmp_path, caplog):
    for step in (5, 6):
        save_checkpoint(tmp_path, step, {"step": step}, keep_last=2)
    with caplog.at_level(logging.WARNING, logger="ddpkit.checkpoint"):
        save_checkpoint(tmp_path, 3, {"step": 3}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000005", "step-00000006"]
    assert "--resume auto would pick step-00000006" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_last": 0}, "keep_last must be an int >= 1, got 0"),
        ({"step": -1}, "got -1"),
        ({"state": [1]}, "dict"),
    ],
)
def test_bad_arguments_are_config_errors(tmp_path, kwargs, match):
    args = {"directory": tmp_path, "step": 1, "state": {"a": 1}, "keep_last": 2} | kwargs
    with pytest.raises(ConfigError, match=match):
        save_checkpoint(**args)
    assert list(tmp_path.iterdir()) == []


def test_state_that_weights_only_refuses_fails_the_save(tmp_path):
    save_checkpoint(tmp_path, 1, {"step": 1})
    with pytest.raises(ConfigError, match=r"step 2.*weights_only=True.*numpy.*torch.from_numpy"):
        save_checkpoint(tmp_path, 2, {"step": 2, "bad": np.zeros(3)})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001"]
    assert hidden(tmp_path) == []


def test_crash_inside_torch_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    good = make_state(step=1)
    save_checkpoint(tmp_path, 1, good)
    real_save = torch.save

    def half_then_crash(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(f.tell() // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path, 2, make_state(step=2))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001"]
    assert hidden(tmp_path) == []
    assert_same(good, load_latest(tmp_path)[1])


def test_crash_at_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    good = make_state(step=1)
    save_checkpoint(tmp_path, 1, good)

    def refuse(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="Input/output"):
        save_checkpoint(tmp_path, 2, make_state(step=2))
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001"]
    assert_same(good, load_checkpoint(tmp_path / "step-00000001"))


KILLED_SAVE = """
import os, sys, torch
from ddpkit.checkpoint import save_checkpoint
real_save = torch.save
def save_then_die(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    f.flush()
    os._exit(9)  # like SIGKILL: no except, no finally, no cleanup
torch.save = save_then_die
save_checkpoint(sys.argv[1], 2, {"step": 2, "w": torch.ones(1000)})
"""


def test_killed_save_leaves_the_previous_checkpoint_and_the_next_save_cleans_up(tmp_path):
    save_checkpoint(tmp_path, 1, {"step": 1, "w": torch.zeros(1000)})
    code = textwrap.dedent(KILLED_SAVE)
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 9, done.stderr
    [leftover] = hidden(tmp_path)
    assert leftover.startswith(".step-00000002.") and leftover.endswith(".tmp")
    path, state = load_latest(tmp_path)
    assert path.name == "step-00000001" and torch.equal(state["w"], torch.zeros(1000))
    save_checkpoint(tmp_path, 3, {"step": 3})
    assert hidden(tmp_path) == []
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001", "step-00000003"]


@pytest.mark.parametrize("atomic_swap", [True, False])
def test_saving_a_step_again_replaces_it(tmp_path, monkeypatch, atomic_swap):
    if not atomic_swap:
        monkeypatch.setattr(store, "exchange", lambda a, b: False)
    save_checkpoint(tmp_path, 4, {"v": torch.zeros(3)})
    path = save_checkpoint(tmp_path, 4, {"v": torch.ones(3)})
    assert torch.equal(load_checkpoint(path)["v"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]


def test_failed_replace_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 4, {"v": torch.zeros(3)})
    monkeypatch.setattr(store, "exchange", lambda a, b: False)
    real_replace, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # old moved aside, the new one fails to move in
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 4, {"v": torch.ones(3)})
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(tmp_path / "step-00000004")["v"], torch.zeros(3))
    assert hidden(tmp_path) == []


def test_checkpoint_moved_aside_by_a_killed_replace_is_restored(tmp_path):
    path = save_checkpoint(tmp_path, 4, {"v": torch.zeros(3)})
    os.replace(path, tmp_path / ".step-00000004.0badc0de.replaced.tmp")  # killed between the two renames
    save_checkpoint(tmp_path, 5, {"v": torch.ones(3)}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    assert torch.equal(load_checkpoint(path)["v"], torch.zeros(3))
    assert hidden(tmp_path) == []


def test_exchange_swaps_two_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "from_a").touch()
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this kernel or filesystem has no renameat2(RENAME_EXCHANGE)")
    assert (tmp_path / "b" / "from_a").exists() and not (tmp_path / "a" / "from_a").exists()


def test_resolve_resume(tmp_path, caplog):
    ckpts = tmp_path / "checkpoints"
    assert resolve_resume(ckpts, "auto") is None
    first = save_checkpoint(ckpts, 1, {"step": 1})
    second = save_checkpoint(ckpts, 2, {"step": 2})
    assert resolve_resume(ckpts, "never") is None
    assert resolve_resume(ckpts, "auto") == second
    assert resolve_resume(ckpts, str(first)) == first
    flip_byte(second)
    with caplog.at_level(logging.WARNING, logger="ddpkit.checkpoint"):
        assert resolve_resume(ckpts, "auto") == first
    assert (
        f"checkpoint {second} is corrupt (xxh3_128 mismatch in state.pt); falling back to {first}"
        in caplog.text
    )


@pytest.mark.parametrize(
    ("make_arg", "match"),
    [
        (
            lambda d: str(d / "step-00000099"),
            r"step-00000099' does not exist; pass a checkpoint directory, auto",
        ),
        (lambda d: str(d / "step-00000002"), r"step-00000002' is not a good checkpoint \(xxh3_128 mismatch"),
        (lambda d: str(d), r"missing manifest.json\); it holds checkpoints, such as .*step-00000002"),
    ],
)
def test_resolve_resume_rejects_bad_paths(tmp_path, make_arg, match):
    save_checkpoint(tmp_path, 1, {"step": 1})
    flip_byte(save_checkpoint(tmp_path, 2, {"step": 2}))
    with pytest.raises(ConfigError, match=match):
        resolve_resume(tmp_path, make_arg(tmp_path))
