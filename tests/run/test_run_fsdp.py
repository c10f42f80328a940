"""engine="fsdp" (torch's FSDP2) keeps ddpkit.Run's guarantees: the same losses and weights on 1, 2
and 3 processes (with micro_batch, grad_clip and the loop's own clip_grad_norm_), the full-copy
engine's model, a job killed inside a sharded checkpoint's write that the same command resumes bit
for bit (never from the half-written checkpoint), and the same job resumed on 3 processes.

The script is tests/run/fsdp_script.py; the runs are shared between the tests (module fixtures).
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from fsdp_script import Net
from helpers import ddpkit_run, logged_losses, metric_lines, saved_weights

from ddpkit.checkpoint.inspect import inspect_path

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("fsdp_script.py")
STEPS = 15  # 3 epochs of 60 samples in global batches of 12
KILL_IN_SAVE = 8  # mid-epoch 1 (steps 6 to 10); the checkpoint of step 6 is the one to resume


def _run(out: Path, nproc: int, *extra: str, code: int = 0) -> subprocess.CompletedProcess:
    return ddpkit_run(SCRIPT, out, nproc, *extra, code=code, timeout=300)


def _assert_close(ours: dict, theirs: dict, rtol: float, atol: float) -> None:
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=rtol, atol=atol, msg=key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs, micro-batches of 2 throughout: fsdp on 1, 2 and 3 processes (2 also with
    the parameters kept gathered between forward and backward), and torch's DDP on 2."""
    root = tmp_path_factory.mktemp("fsdp")
    outs = {}
    for name, nproc, extra in [
        ("fsdp-1", 1, ()),
        ("fsdp-2", 2, ()),
        ("fsdp-3", 3, ("--zero2",)),
        ("torch-2", 2, ("--engine", "torch")),
    ]:
        outs[name] = root / name
        _run(outs[name], nproc, "--micro-batch", "2", *extra)
    return outs


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """The fsdp job on 2 processes, rank 0 SIGKILLed inside its DCP write of step 8's checkpoint."""
    out = tmp_path_factory.mktemp("fsdp-killed") / "run"
    _run(out, 2, "--micro-batch", "2", "--kill-in-save", str(KILL_IN_SAVE), code=1)
    return out


def test_the_same_losses_and_weights_on_1_2_and_3_processes(runs):
    reference = logged_losses(runs["fsdp-1"])
    assert len(reference) == STEPS
    for name in ("fsdp-2", "fsdp-3"):
        assert logged_losses(runs[name]) == pytest.approx(reference, rel=1e-5), name
        _assert_close(saved_weights(runs[name]), saved_weights(runs["fsdp-1"]), rtol=1e-4, atol=1e-5)
        # The EMA, each rank averaging its own shards: the same average on any number of ranks.
        _assert_close(
            saved_weights(runs[name], "ema"), saved_weights(runs["fsdp-1"], "ema"), rtol=1e-4, atol=1e-5
        )
    # run.evaluate over uneven shards (2 and 1 batches on 2 ranks) kept the ranks in step, with
    # the model's own weights and with the EMA's swapped in.
    for field in ("val_acc", "ema_acc"):
        accuracies = [[line[field] for line in metric_lines(runs[n]) if field in line] for n in runs]
        assert all(acc == pytest.approx(accuracies[0]) for acc in accuracies) and len(accuracies[0]) == 3


def test_model_pt_is_the_full_copy_engines(runs):
    # OUT/model.pt: a full, plain-keyed state dict gathered from the shards, torch's DDP's model.
    sharded, full = saved_weights(runs["fsdp-2"]), saved_weights(runs["torch-2"])
    assert sorted(sharded) == sorted(full)
    for key, value in full.items():
        assert not hasattr(sharded[key], "placements"), f"{key} is still a DTensor"
        torch.testing.assert_close(sharded[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert logged_losses(runs["fsdp-2"]) == pytest.approx(logged_losses(runs["torch-2"]), rel=1e-5)
    # OUT/ema.pt: the full-copy engine's EMA, and it loads into a fresh model.
    _assert_close(
        saved_weights(runs["fsdp-2"], "ema"), saved_weights(runs["torch-2"], "ema"), rtol=1e-5, atol=1e-6
    )
    Net().load_state_dict(saved_weights(runs["fsdp-2"], "ema"))
    assert not torch.equal(saved_weights(runs["fsdp-2"], "ema")["head.weight"], sharded["head.weight"])


def test_a_checkpoint_killed_mid_write_is_never_loaded_and_the_rerun_is_bit_equal(runs, killed, tmp_path):
    saved = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert f"step-{KILL_IN_SAVE - 2:08d}" in saved and f"step-{KILL_IN_SAVE:08d}" not in saved, saved
    assert any(name.startswith(f".step-{KILL_IN_SAVE:08d}.") for name in saved), "no half-written folder"
    out = tmp_path / "rerun"
    shutil.copytree(killed, out)
    done = _run(out, 2, "--micro-batch", "2")
    assert f"resumed from {out / 'checkpoints' / f'step-{KILL_IN_SAVE - 2:08d}'}" in done.stdout
    whole = saved_weights(runs["fsdp-2"])
    assert all(torch.equal(saved_weights(out)[k], v) for k, v in whole.items()), "the rerun's model differs"
    whole = saved_weights(runs["fsdp-2"], "ema")
    assert all(torch.equal(saved_weights(out, "ema")[k], v) for k, v in whole.items()), (
        "the rerun's EMA differs"
    )
    assert logged_losses(out) == logged_losses(runs["fsdp-2"])
    # ddpkit inspect reads a sharded checkpoint: its manifest covers every rank's DCP files.
    assert inspect_path(out / "checkpoints") == 0


def test_killed_on_2_and_resumed_on_3(runs, killed, tmp_path):
    out = tmp_path / "on3"
    shutil.copytree(killed, out)
    done = _run(out, 3, "--micro-batch", "2")
    assert "resumed from" in done.stdout
    _assert_close(saved_weights(out), saved_weights(runs["fsdp-2"]), rtol=1e-4, atol=1e-5)
    _assert_close(saved_weights(out, "ema"), saved_weights(runs["fsdp-2"], "ema"), rtol=1e-4, atol=1e-5)
    taken = collections.Counter()
    for path in (out / "samples").glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            taken.update(json.loads(line)["indices"])
    assert taken == {i: 3 for i in range(60)}, "3 epochs must use every sample 3 times"


def test_a_block_skipped_on_one_rank_is_one_line_on_every_rank(tmp_path):
    done = _run(tmp_path / "skip", 2, "--skip-block-at", "2", code=2)
    said = [line for line in done.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert said, done.stderr[-3000:]
    assert "is at blocks.1's forward while rank 1 is at blocks.2's forward" in said[0], said
    assert "every rank must call the same sharded modules' forwards in the same order" in said[0]
    assert "SIGABRT" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_full_copy_engine_saving_through_dcp_spreads_the_writes_and_resumes_exactly(runs, tmp_path):
    killed = tmp_path / "torch-dcp"
    cut = ("--kill-in-save", str(KILL_IN_SAVE))
    _run(killed, 2, "--micro-batch", "2", "--engine", "torch", "--sharded-save", *cut, code=1)
    kept = killed / "checkpoints" / f"step-{KILL_IN_SAVE - 2:08d}"
    written = {p.name: p.stat().st_size for p in kept.glob("*.distcp")}
    assert sorted(written) == ["__0_0.distcp", "__1_0.distcp"] and min(written.values()) > 0, written
    for nproc, name in ((2, "same"), (3, "on3")):
        out = tmp_path / name
        shutil.copytree(killed, out)
        assert "resumed from" in _run(out, nproc, "--micro-batch", "2", "--engine", "torch").stdout
        if nproc == 2:  # the same command: bit-equal to the run that saved state.pt and was never killed
            assert all(
                torch.equal(saved_weights(out)[k], v) for k, v in saved_weights(runs["torch-2"]).items()
            )
            assert logged_losses(out) == logged_losses(runs["torch-2"])
        else:
            _assert_close(saved_weights(out), saved_weights(runs["torch-2"]), rtol=1e-4, atol=1e-5)
