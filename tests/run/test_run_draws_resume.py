"""Per-sample draws survive a kill: a run with keyed dropout and the loop's own keyed noise, killed
on 2 processes, ends bit-equal when the same command runs again, and within 1e-5 when resumed on 3
(tests/run/draws_script.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import ddpkit_run, logged_losses, saved_weights

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("draws_script.py")


def test_killed_on_2_the_rerun_is_bit_equal_and_on_3_within_1e_5(tmp_path):
    whole, alone = tmp_path / "whole", tmp_path / "alone"
    ddpkit_run(SCRIPT, whole, 2, timeout=240)
    ddpkit_run(SCRIPT, alone, 1, timeout=240)
    assert logged_losses(alone) == pytest.approx(logged_losses(whole), rel=1e-5)  # 15 steps, 1 vs 2
    for name, nproc in [("same", 2), ("three", 3)]:
        out = tmp_path / name
        ddpkit_run(SCRIPT, out, 2, "--kill-at", "7", code=1, timeout=240)  # mid-epoch 1; step 6 saved
        ddpkit_run(SCRIPT, out, nproc, timeout=240)
        if name == "same":
            assert all(torch.equal(saved_weights(out)[k], v) for k, v in saved_weights(whole).items())
            assert logged_losses(out) == logged_losses(whole)
        else:
            assert logged_losses(out) == pytest.approx(logged_losses(whole), rel=1e-5)
            for key, value in saved_weights(whole).items():
                torch.testing.assert_close(saved_weights(out)[key], value, rtol=1e-5, atol=1e-6, msg=key)
