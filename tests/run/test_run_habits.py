"""A script written the single-device way (tests/run/habits_script.py) gives the single-device
answer under ddpkit.Run: the same losses on 1, 2 and 3 processes with random flips in DataLoader
workers, a bit-equal kill-and-rerun with a schedule sized by len(loader), the same weights with and
without micro_batch despite its own clip_grad_norm_, and every epoch's run.log value in its own line.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ddpkit_run, logged_losses, metric_lines

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("habits_script.py")
STEPS = 15  # 3 epochs of 60 samples in global batches of 12
EPOCHS = 3


def _cmd(out: Path, nproc: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "--nproc",
        str(nproc),
        str(SCRIPT),
        "--out",
        str(out),
        *extra,
    ]


def _run(out: Path, nproc: int, *extra: str, code: int = 0) -> subprocess.CompletedProcess:
    return ddpkit_run(SCRIPT, out, nproc, *extra, code=code, timeout=240)


def _weights(out: Path) -> dict:
    return torch.load(out / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The script's uninterrupted runs on 1, 2 and 3 processes, and on 2 with micro-batches of 2."""
    root = tmp_path_factory.mktemp("habits")
    outs = {}
    for name, nproc, extra in [
        ("1", 1, ()),
        ("2", 2, ()),
        ("3", 3, ()),
        ("2-micro", 2, ("--micro-batch", "2")),
    ]:
        outs[name] = root / name
        _run(outs[name], nproc, *extra)
    return outs


def test_the_same_losses_and_weights_on_1_2_and_3_processes(runs):
    # Random flips and jitter drawn in 2 DataLoader workers: seeded per sample, so every world
    # size draws the same ones (before: 4.7e-2 relative apart).
    reference = logged_losses(runs["1"])
    assert len(reference) == STEPS
    # The schedule is sized by EPOCHS * len(loader) and ends where it would on one device.
    lrs = [line["lr"] for line in metric_lines(runs["1"]) if "loss" in line]
    assert lrs == pytest.approx([1e-2 * min(1, (s + 1) / 3) * (STEPS - s) / STEPS for s in range(STEPS)])
    for name in ("2", "3", "2-micro"):
        assert [line["lr"] for line in metric_lines(runs[name]) if "loss" in line] == lrs, name
    for name in ("2", "3"):
        assert logged_losses(runs[name]) == pytest.approx(reference, rel=1e-5), name
        for key, value in _weights(runs["1"]).items():
            torch.testing.assert_close(_weights(runs[name])[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_own_clip_under_micro_batch_gives_the_same_update(runs):
    # The loop's clip_grad_norm_ runs after every micro-batch's backward; only the step's last one
    # sees a gradient (the whole step's), as without micro_batch (before: 6.8e-2 apart).
    assert logged_losses(runs["2-micro"]) == pytest.approx(logged_losses(runs["2"]), rel=1e-5)
    for key, value in _weights(runs["2"]).items():
        torch.testing.assert_close(_weights(runs["2-micro"])[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_every_epochs_logged_value_has_a_line_of_its_own(runs):
    for out in runs.values():
        logged = [(line["step"], line["epoch"]) for line in metric_lines(out) if "val_acc" in line]
        assert logged == [(5, 0), (10, 1), (15, 2)], out.name
        assert all("val_acc" not in line for line in metric_lines(out) if "loss" in line)


def test_kill_and_rerun_with_a_len_sized_schedule_is_bit_equal(runs, tmp_path):
    # Killed at step 7, mid-epoch 1; resumed from step 6. len(loader) is 5 both times, so the
    # schedule is the uninterrupted run's (before: len() counted what was left of the epoch, 4).
    out = tmp_path / "cut"
    _run(out, 2, "--kill-at", "7", code=1)
    done = _run(out, 2)
    assert "resumed from" in done.stdout
    whole = _weights(runs["2"])
    assert all(torch.equal(_weights(out)[k], v) for k, v in whole.items()), "the rerun's model differs"
    assert logged_losses(out) == logged_losses(runs["2"])
    assert [line["val_acc"] for line in metric_lines(out) if "val_acc" in line] == [
        line["val_acc"] for line in metric_lines(runs["2"]) if "val_acc" in line
    ]


def _extras(out: Path) -> dict:
    return torch.load(out / "extras.pt", weights_only=True)


def test_an_ema_and_the_loops_own_state_are_the_same_on_any_world_size_and_micro_batch(runs):
    # A tracked EMA updates once per optimizer step (before: once per micro-batch, 4 a step on one
    # process and 2 on two, 7.5e-2 apart); the dataset's own numpy generator draws per sample
    # (before: 0.44 apart between 1 and 2 processes).
    reference = _extras(runs["1"])
    assert int(reference["ema"]["n_averaged"]) == STEPS
    assert reference["loop"]["validations"] == EPOCHS
    for name in ("2", "3", "2-micro"):
        extras = _extras(runs[name])
        assert extras["loop"] == pytest.approx(reference["loop"]), name
        for key, value in reference["ema"].items():
            torch.testing.assert_close(extras["ema"][key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def test_killed_right_after_an_epoch_the_rerun_has_run_its_epoch_end_code_once(runs, tmp_path):
    # Killed at step 11, epoch 2's first: resumed from step 10, epoch 1's last, whose checkpoint
    # once came before epoch 1's validation and loop state (the rerun never ran them).
    out = tmp_path / "cut"
    _run(out, 2, "--kill-at", "11", code=1)
    _run(out, 2)
    whole, cut = _extras(runs["2"]), _extras(out)
    assert cut["loop"] == whole["loop"]
    assert all(torch.equal(cut["ema"][k], v) for k, v in whole["ema"].items()), "the rerun's EMA differs"
    assert all(torch.equal(_weights(out)[k], v) for k, v in _weights(runs["2"]).items())


def test_a_checkpoint_on_rank_0_only_is_reported_not_a_silent_hang(tmp_path, short_tmpdir):
    # `if run.rank == 0: run.save()` after epoch 0: rank 0 waits in the checkpoint's gather, rank 1
    # in epoch 1's gradient all-reduce. No flag: the default desync_timeout (30 s) reports it, where
    # before the job sat silent until the 30-minute collective timeout.
    start = time.monotonic()  # the launcher's run folder goes to short_tmpdir
    done = _run(tmp_path / "out", 2, "--rank0-save", code=1)
    assert time.monotonic() - start < 90, "the desync was not reported within the default 30 s (+ start-up)"
    report = (tmp_path / "out" / "hang-report.txt").read_text()
    save_line = next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "run.save()" in line)
    assert "desync" in done.stderr and f"habits_script.py:{save_line}" in report, done.stderr[-3000:]
    assert "rank 0" in report and "rank 1" in report
