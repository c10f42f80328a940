"""A script written the single-device way (tests/run/habits_script.py) gives the single-device
answer under ddpkit.Run: the same losses on 1, 2 and 3 processes with random flips in DataLoader
workers, a bit-equal kill-and-rerun with a schedule sized by len(loader), the same weights with and
without micro_batch despite its own clip_grad_norm_, and every epoch's run.log value in its own line.
With --plateau (issue 26's script: validation, ReduceLROnPlateau, early stopping, an EMA under
micro_batch, the dataset's own generator, a layer unfrozen at epoch 1): the same on 1, 2 and 3
processes, bit-equal after a kill inside or right after the epoch-end code, and the finished
command run again changes nothing.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import ddpkit_run, logged_losses, metric_lines, saved_weights

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("habits_script.py")
STEPS = 15  # 3 epochs of 60 samples in global batches of 12
EPOCHS = 3


def _run(out: Path, nproc: int, *extra: str, code: int = 0) -> subprocess.CompletedProcess:
    return ddpkit_run(SCRIPT, out, nproc, *extra, code=code, timeout=240)


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
        for key, value in saved_weights(runs["1"]).items():
            torch.testing.assert_close(saved_weights(runs[name])[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_own_clip_under_micro_batch_gives_the_same_update(runs):
    # The loop's clip_grad_norm_ runs after every micro-batch's backward; only the step's last one
    # sees a gradient (the whole step's), as without micro_batch (before: 6.8e-2 apart).
    assert logged_losses(runs["2-micro"]) == pytest.approx(logged_losses(runs["2"]), rel=1e-5)
    for key, value in saved_weights(runs["2"]).items():
        torch.testing.assert_close(saved_weights(runs["2-micro"])[key], value, rtol=1e-5, atol=1e-6, msg=key)


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
    whole = saved_weights(runs["2"])
    assert all(torch.equal(saved_weights(out)[k], v) for k, v in whole.items()), "the rerun's model differs"
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


@pytest.fixture(scope="module")
def plateau_runs(tmp_path_factory) -> dict:
    """--plateau (ReduceLROnPlateau and early stopping) on 1 process, on 2 with micro-batches of 2,
    and on 3."""
    root = tmp_path_factory.mktemp("plateau")
    outs = {}
    for name, nproc, extra in [("1", 1, ()), ("2-micro", 2, ("--micro-batch", "2")), ("3", 3, ())]:
        outs[name] = root / name
        # Data seed 3: a run whose accuracy falls twice in a row at epochs 5 and 6 (the per-sample
        # draws decide which epochs; this seed's stop exercises the early stopping).
        _run(outs[name], nproc, "--plateau", "--data-seed", "3", *extra)
    return outs


def _lrs(out: Path) -> list[float]:
    return [line["lr"] for line in metric_lines(out) if "loss" in line]


def test_a_plateau_and_early_stopping_loop_is_the_same_on_1_2_and_3_processes(plateau_runs):
    # Validation, a plateau scheduler, early stopping, an EMA under micro_batch, the dataset's own
    # generator in 2 workers and a layer unfrozen at epoch 1: the same run on every world size.
    reference = _extras(plateau_runs["1"])
    assert reference["loop"]["validations"] == 6 and reference["loop"]["bad_epochs"] == 2  # stopped at 6 of 8
    assert sorted(set(_lrs(plateau_runs["1"])), reverse=True) == [1e-2, 5e-3]  # halved after epoch 4
    for name in ("2-micro", "3"):
        extras = _extras(plateau_runs[name])
        assert extras["loop"] == reference["loop"], name
        assert _lrs(plateau_runs[name]) == _lrs(plateau_runs["1"]), name
        assert logged_losses(plateau_runs[name]) == pytest.approx(logged_losses(plateau_runs["1"]), rel=1e-5)
        for key, value in reference["ema"].items():
            torch.testing.assert_close(extras["ema"][key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
        for key, value in saved_weights(plateau_runs["1"]).items():
            torch.testing.assert_close(
                saved_weights(plateau_runs[name])[key], value, rtol=1e-5, atol=1e-6, msg=key
            )


@pytest.mark.parametrize("kill", [("--kill-in-epoch-end", "4"), ("--kill-at", "26")])
def test_killed_in_or_right_after_the_epoch_end_code_the_rerun_is_bit_equal(plateau_runs, tmp_path, kill):
    # Inside epoch 4's end code (after the plateau halved the rate, before the loop's counters), or
    # at step 26, the next epoch's first: the rerun runs epoch 4's end exactly once. Step 26 once
    # resumed from a checkpoint taken before epoch 4's validation, which the rerun then never ran.
    # Then the finished command, run again, changes nothing.
    out, command = tmp_path / "cut", ("--plateau", "--data-seed", "3", "--micro-batch", "2")
    _run(out, 2, *command, *kill, code=1)
    assert "resumed from" in _run(out, 2, *command).stdout
    whole = plateau_runs["2-micro"]
    assert _extras(out)["loop"] == _extras(whole)["loop"]
    assert all(torch.equal(_extras(out)["ema"][k], v) for k, v in _extras(whole)["ema"].items()), (
        "EMA differs"
    )
    assert all(torch.equal(saved_weights(out)[k], v) for k, v in saved_weights(whole).items()), (
        "the model differs"
    )
    assert logged_losses(out) == logged_losses(whole) and _lrs(out) == _lrs(whole)
    if kill[0] == "--kill-at":
        written = (out / "model.pt").read_bytes()
        again = _run(out, 2, *command)
        assert "nothing to do" in again.stdout and (out / "model.pt").read_bytes() == written


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
