"""A user's small loop for ``ddpkit check`` (tests/check/test_check_command.py): an MLP with AdamW.
Each flag adds a habit that no world size keeps the same: ``--batchnorm`` a BatchNorm1d in training
mode, ``--dropout`` an nn.Dropout without invariant_dropout, ``--mixup`` a Mixup over the
micro-batch (torch.randperm, its weight from numpy's global generator). ``--penalty`` scales the
output by a mean over a million weights, whose rounding changes with the CPU thread count."""

import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import ddpkit

run = ddpkit.Run(out="runs/mine", global_batch=12, save_every=5)
layers = [nn.Linear(6, 16)] + ([nn.BatchNorm1d(16)] if "--batchnorm" in sys.argv else []) + [nn.GELU()]
layers += [nn.Dropout(0.3)] if "--dropout" in sys.argv else []
net = nn.Sequential(*layers, nn.Linear(16, 2))
if "--penalty" in sys.argv:  # a mean over a million weights: its rounding follows the thread count
    spread = torch.randn(1_000_000, generator=torch.Generator().manual_seed(2))
    net.register_parameter("spread", nn.Parameter(spread))
model = run.setup(net)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
run.track(optimizer)
generator = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(
    torch.randn(60, 6, generator=generator), torch.randn(60, 2, generator=generator)
)
loader = run.loader(data)
for _epoch in range(loader.epoch, 3):
    for x, y in loader:
        if "--mixup" in sys.argv:
            lam, order = float(np.random.beta(0.4, 0.4)), torch.randperm(len(x))
            x, y = lam * x + (1 - lam) * x[order], lam * y + (1 - lam) * y[order]
        out = model(x)
        if "--penalty" in sys.argv:
            spread = ddpkit.unwrap(model).spread
            out = out * torch.dot(spread, spread) / spread.numel()
        loss = F.mse_loss(out, y)
        optimizer.zero_grad()
        run.backward(loss)
        optimizer.step()
run.finish()
