"""``run.loss``: the global loss of the last metrics line, on every rank, the same on 1, 2 and 3
processes, and the value ``metrics.jsonl`` holds (tests/run/loss_cases.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import logged_losses

import ddpkit
from ddpkit.launch.start_method import FORKSERVER

sys.path.insert(0, str(Path(__file__).parent))
from loss_cases import read_losses  # noqa: E402

pytestmark = pytest.mark.slow


def test_run_loss_is_the_logged_global_loss_on_any_world_size(tmp_path):
    runs = {
        n: ddpkit.launch(read_losses, n, (str(tmp_path / str(n)),), start_method=FORKSERVER)
        for n in (1, 2, 3)
    }
    reference = runs[1][0]
    # A line is gathered without a wait, closed at the next step's start and read back at the
    # end of the one after: in the loop run.loss is the line of two steps before.
    assert [loss for _, loss in reference[:2]] == [None, None]
    logged = logged_losses(tmp_path / "1")
    assert [loss for _, loss in reference[2:]] == pytest.approx(logged[:2], rel=1e-12)
    for n, ranks in runs.items():
        for seen in ranks:  # every rank reads the same number
            assert [step for step, _ in seen] == [1, 2, 3, 4]
            ours = [loss for _, loss in seen[2:]]
            assert ours == pytest.approx([loss for _, loss in reference[2:]], rel=1e-6), n
