"""A loop that reads ``run.loss`` every step: what tests/run/test_run_loss.py launches on 1, 2, 3."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def read_losses(out: str) -> list:
    """``(run.step, run.loss)`` at each step's end, on this rank."""
    run = ddpkit.Run(out=out, global_batch=12, log_every=1, progress=False)
    torch.manual_seed(0)
    model = run.setup(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for x, y in run.loader(
        TensorDataset(torch.randn(48, 4, generator=gen), torch.randn(48, 1, generator=gen))
    ):
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
        seen.append((run.step, run.loss))
    run.finish()
    return seen
