"""A diffusion-style loop whose model drops out, ported to ddpkit.Run with the per-sample options:
``invariant_dropout=True`` and the loop's noise and timesteps from ``run.randn_like`` and
``run.randint``. tests/run/test_run_draws_resume.py kills it and runs it again.

Flags: --out, --kill-at STEP (rank 0 SIGKILLs itself after that step).
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

T = 100  # diffusion timesteps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()
    run = ddpkit.Run(
        out=args.out, global_batch=12, save_every=2, log_every=1, progress=False, invariant_dropout=True
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 32), nn.SiLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    model = run.setup(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run.track(optimizer)
    x0 = torch.randn(50, 4, generator=torch.Generator().manual_seed(1))
    loader = run.loader(TensorDataset(x0))
    for _ in range(loader.epoch, 3):
        for (x,) in loader:
            t = run.randint(T, like=x)  # (B,)
            alpha = torch.cos(t.float() / T * torch.pi / 2).unsqueeze(1) ** 2  # (B, 1)
            noise = run.randn_like(x)
            noisy = alpha.sqrt() * x + (1 - alpha).sqrt() * noise
            loss = F.mse_loss(model(torch.cat([noisy, t.float().unsqueeze(1) / T], 1)), noise)
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            if run.step == args.kill_at and run.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    run.finish()


if __name__ == "__main__":
    main()
