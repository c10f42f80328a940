"""A user's small loop for ``ddpkit check`` (tests/check/test_check_command.py): an MLP with AdamW,
and with ``--batchnorm`` a BatchNorm1d in training mode, which no world size can keep the same."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit

run = ddpkit.Run(out="runs/mine", global_batch=12, save_every=5)
layers = [nn.Linear(6, 16)] + ([nn.BatchNorm1d(16)] if "--batchnorm" in sys.argv else []) + [nn.GELU()]
model = run.setup(nn.Sequential(*layers, nn.Linear(16, 2)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
run.track(optimizer)
generator = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(
    torch.randn(60, 6, generator=generator), torch.randn(60, 2, generator=generator)
)
loader = run.loader(data)
for _epoch in range(loader.epoch, 3):
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        run.backward(loss)
        optimizer.step()
run.finish()
