"""A small loop on ddpkit.Run with every tracker on, for tests/run/test_trackers.py.

    ddpkit run --nproc 2 tests/run/trackers_script.py --out OUT [--hold-at STEP]

40 steps (5 epochs of 8), a checkpoint every 10, a metrics line every step with a value logged
in the step (``acc``) and one logged between epochs (``val``). ``--hold-at`` makes every rank
wait at that step until killed, so the test can kill the job once the trackers got the lines
after the last checkpoint.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold-at", type=int, default=0)
    args = parser.parse_args()
    run = ddpkit.Run(
        out=args.out, global_batch=8, save_every=10, log_every=1, progress=False,
        trackers=["tensorboard", "mlflow", "wandb"],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(64, 6, generator=gen), torch.randn(64, 2, generator=gen))
    model = run.setup(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    loader = run.loader(data)
    for epoch in range(loader.epoch, 5):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            run.backward(loss)
            optimizer.step()
            run.log(acc=loss.item() / 2)
            while run.step == args.hold_at:  # until the test kills the job
                time.sleep(0.05)
        run.log(val=float(epoch))
    run.finish()


if __name__ == "__main__":
    main()
