"""A ddpkit.Run loop on a small residual MLP whose blocks the default policy shards one by one.
tests/run/test_run_fsdp.py runs it under `ddpkit run` with ``--engine fsdp`` and ``torch``.

The loop clips the gradient itself (``clip_grad_norm_``) on top of ``grad_clip``, steps an LR
schedule, keeps an EMA of the weights (``ddpkit.EMA``, sharded as the model on fsdp, OUT/ema.pt
at the end), and validates the model and its EMA with ``run.evaluate`` on a split whose shards
are uneven (the sharded model's forwards are collectives: ranks with fewer batches must keep in step).

Flags: --out, --engine, --micro-batch N, --kill-at STEP (rank 0 SIGKILLs itself after that
step), --kill-in-save STEP (rank 0 SIGKILLs itself inside its DCP write of that step), --zero2,
--skip-block-at STEP (rank 1 alone skips a block's forward at that step), --sharded-save.
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS = 3


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        x = self.inp(x)
        for index, block in enumerate(self.blocks):
            if index != skip:
                x = block(x)
        return self.head(x)


def data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long())


def kill_inside_save(step: int) -> None:
    """This rank dies inside its DCP write of ``step``'s checkpoint (the rank that would commit it)."""
    import torch.distributed.checkpoint.filesystem as fs

    write = fs._write_files_from_queue

    def dying(*args, **kwargs):
        if os.environ.get("DDPKIT_TEST_STEP") == str(step):
            os.kill(os.getpid(), signal.SIGKILL)
        return write(*args, **kwargs)

    fs._write_files_from_queue = dying


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", default="fsdp")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--kill-in-save", type=int, default=0)
    parser.add_argument("--zero2", action="store_true")
    parser.add_argument("--sharded-save", action="store_true", help="the full-copy engines save through DCP")
    parser.add_argument("--skip-block-at", type=int, default=0, help="rank 1 skips block 1 at this step")
    args = parser.parse_args()

    run = ddpkit.Run(
        out=args.out, engine=args.engine, global_batch=12, micro_batch=args.micro_batch, save_every=2,
        log_every=1, progress=False, grad_clip=1.0, reshard_after_forward=not args.zero2, check_every=3,
        log_samples=True, sharded_save=True if args.sharded_save else None,
    )  # fmt: skip
    model = run.setup(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
    loader = run.loader(data(60, seed=0))
    total = EPOCHS * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (total - step) / total)
    ema = ddpkit.EMA(model, decay=0.8)
    run.track(optimizer, scheduler, ema=ema)
    held_out = data(9, seed=1)  # 5 and 4 samples on 2 ranks: 2 and 1 batches of 4
    if args.kill_in_save and run.rank == 0:
        kill_inside_save(args.kill_in_save)
    for _epoch in range(loader.epoch, EPOCHS):
        for x, y in loader:
            skip = 1 if run.rank == 1 and run.step == args.skip_block_at else None
            loss = F.cross_entropy(model(x, skip), y)
            optimizer.zero_grad()
            run.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            optimizer.step()
            scheduler.step()
            ema.update()
            os.environ["DDPKIT_TEST_STEP"] = str(run.step)
            if run.step == args.kill_at and run.rank == 0 and run.at_step_end:
                os.kill(os.getpid(), signal.SIGKILL)

        def accuracy(batch):
            return (model(batch[0]).argmax(1) == batch[1]).float().mean()

        with ema.applied():
            averaged = run.evaluate(held_out, accuracy, batch_size=4)
        run.log(val_acc=run.evaluate(held_out, accuracy, batch_size=4)["value"], ema_acc=averaged["value"])
    run.finish()


if __name__ == "__main__":
    main()
