"""A ddpkit.Run loop with dropout that checkpoints every 2 steps, synchronously or with
``async_save=True``; tests/run/test_run_async_save.py runs it under `ddpkit run`.

Flags: --out, --engine (torch or fsdp), --async-save, --die-in-write STEP (rank 0 SIGKILLs itself
from the writing thread, inside its write of that step's checkpoint, once state.pt is written and
before the rename), --slow-staging (a sharded save's background copy into host memory takes
0.2 s more, as a device-to-host copy of a large model does: the step must wait for it before it
changes the weights, or the checkpoint holds the next step's), --batchnorm (the model holds
running statistics, which the next forward changes: the copy is waited for before it).
"""

import argparse
import os
import signal
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.checkpoint import store


def die_in_write(step: int) -> None:
    """The writing thread kills its process inside ``step``'s commit, before the rename."""
    write = store._write

    def dying(tmp, at, *args, **kwargs):
        write(tmp, at, *args, **kwargs)
        if at == step:
            assert threading.current_thread().name == "ddpkit-checkpoint-writer"
            os.kill(os.getpid(), signal.SIGKILL)

    store._write = dying


def slow_staging() -> None:
    """Every copy the stager makes in its own thread starts 0.2 s late."""
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager._stage

    def slow(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
        return stage(self, *args, **kwargs)

    DefaultStager._stage = slow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--die-in-write", type=int, default=0)
    parser.add_argument("--slow-staging", action="store_true")
    parser.add_argument("--batchnorm", action="store_true")
    args = parser.parse_args()

    run = ddpkit.Run(
        out=args.out, global_batch=8, save_every=2, keep_last=3, log_every=1, progress=False,
        async_save=args.async_save, engine=args.engine,
    )  # fmt: skip
    norm = [nn.BatchNorm1d(32)] if args.batchnorm else []  # running statistics a forward changes
    model = run.setup(nn.Sequential(nn.Linear(6, 32), *norm, nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run.track(optimizer)
    if args.slow_staging:
        slow_staging()
    if args.die_in_write and run.rank == 0:
        die_in_write(args.die_in_write)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=gen)
    loader = run.loader(TensorDataset(x, x.sum(1, keepdim=True).sin()))
    for _epoch in range(loader.epoch, 2):
        for inputs, targets in loader:
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(inputs), targets))
            optimizer.step()
    run.finish()


if __name__ == "__main__":
    main()
