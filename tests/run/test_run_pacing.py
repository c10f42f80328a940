"""Default log lines and replica checks are paced by the median step, identically on every rank."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.launch.start_method import FORKSERVER
from ddpkit.run.monitor.metrics import read_metrics
from ddpkit.run.monitor.monitor import CHECK_EVERY, CHECK_INTERVAL_S, LOG_EVERY, LOG_INTERVAL_S, paced_every

STEPS, PAUSE_STEP, PAUSE_S = 400, 150, 0.5


def test_paced_every_picks_the_first_choice_that_lasts_the_interval():
    assert paced_every(0.02, LOG_EVERY, LOG_INTERVAL_S) == 10  # slow steps: every 10, as fixed
    assert paced_every(0.001, LOG_EVERY, LOG_INTERVAL_S) == 100
    assert paced_every(0.0006, LOG_EVERY, LOG_INTERVAL_S) == 200
    assert paced_every(1e-7, LOG_EVERY, LOG_INTERVAL_S) == 1000  # never rarer than the last choice
    assert paced_every(0.004, CHECK_EVERY, CHECK_INTERVAL_S) == 500


def _fast_loop(out: str) -> tuple[int, int]:
    run = ddpkit.Run(out=out, global_batch=4, progress=False)
    model = run.setup(nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.track(optimizer)
    data = TensorDataset(torch.randn(4 * STEPS, 3), torch.randn(4 * STEPS, 1))
    for x, y in run.loader(data):
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
        if run.step == PAUSE_STEP:
            time.sleep(PAUSE_S)  # an evaluation, say: one long step among short ones
    run.finish()
    return run._monitor.every, run._monitor.check_every


@pytest.mark.slow
def test_a_fast_loop_logs_less_often_and_every_rank_paces_alike(tmp_path):
    paces = ddpkit.launch(_fast_loop, 2, (str(tmp_path),), start_method=FORKSERVER)
    assert paces[0] == paces[1]  # else the ranks' gathers would not have matched
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in records]
    assert steps[0] == 1 and steps[-1] == STEPS
    assert all(s % 10 == 0 for s in steps[1:])
    assert len(records) < 1 + STEPS // 10  # fewer lines than a fixed every 10 steps writes
    # The run's last pace is the one its last line's median step gives.
    every, check_every = paces[0]
    assert every == paced_every(records[-1]["step_s"], LOG_EVERY, LOG_INTERVAL_S)
    assert check_every == paced_every(records[-1]["step_s"], CHECK_EVERY, CHECK_INTERVAL_S)
    # The pause lengthens its window's mean step, not the median that pacing uses.
    pairs = zip(records, records[1:], strict=False)
    before, paused = next((a, b) for a, b in pairs if a["step"] < PAUSE_STEP <= b["step"])
    mean = paused["time_s"] / (paused["step"] - before["step"])
    assert paused["time_s"] > PAUSE_S and paused["step_s"] < mean / 2
