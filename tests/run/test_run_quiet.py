"""Quiet by default: a 100-step run that checkpoints every 10 steps prints no line per checkpoint,
and one at its end that says how many and the last."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def test_checkpoints_are_one_line_at_the_end(tmp_path, capfd):
    run = ddpkit.Run(out=tmp_path / "run", global_batch=4, save_every=10, steps=100, progress=False)
    model = run.setup(nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.track(optimizer)
    for x, y in run.loader(TensorDataset(torch.randn(400, 3), torch.randn(400, 1))):
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
    run.finish()
    err = capfd.readouterr().err.splitlines()
    assert not [line for line in err if "saved" in line], err
    said = [line for line in err if "checkpoint(s) written" in line]
    assert len(said) == 1 and "10 checkpoint(s) written, the last" in said[0] and "step-00000100" in said[0]
