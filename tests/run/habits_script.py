"""A single-device training script ported to ddpkit.Run by the README, keeping five habits of
single-device code. tests/run/test_run_habits.py runs it under `ddpkit run` and holds ddpkit to
what the same script means on one device:

1. the LR schedule is sized by ``EPOCHS * len(loader)``;
2. the dataset draws a random flip and jitter in ``__getitem__``, in 2 DataLoader workers;
3. the loop clips the gradient itself with ``clip_grad_norm_`` before ``optimizer.step()``;
4. a per-epoch validation accuracy is logged with ``run.log`` after each epoch;
5. with ``--rank0-save``, a checkpoint is asked for on rank 0 only (the classic bug: a collective
   only one rank calls), which ddpkit must report instead of hanging;
6. the dataset also draws from a numpy generator it owns (``self.rng``);
7. an EMA of the weights (``AveragedModel``) is updated after every ``optimizer.step()``;
8. the loop keeps its own state after each epoch (best accuracy, epochs without improvement),
   written with the EMA to OUT/extras.pt at the end;
9. the first layer is frozen before ``run.setup`` and unfrozen at epoch 1 (fine-tuning's recipe);
10. with ``--plateau``, a ReduceLROnPlateau on the validation accuracy instead of the per-step
    schedule, and early stopping after two epochs without improvement, over at most 8 epochs.

Flags: --out, --micro-batch N, --kill-at STEP (rank 0 SIGKILLs itself after that step),
--kill-in-epoch-end EPOCH (rank 0 SIGKILLs itself after that epoch's plateau step, before the
loop's counters), --rank0-save, --plateau.
"""

import argparse
import os
import signal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import ddpkit

EPOCHS = 3


class Flips(Dataset):
    """4x4 one-channel 'images' with a random horizontal flip and jitter in __getitem__."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, 4, 4, generator=gen)
        self.y = (self.x[..., :2].mean((1, 2, 3)) > 0).long()
        self.rng = np.random.default_rng(seed)  # the dataset's own generator

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        shift = float(self.rng.normal(scale=0.05))
        return x + 0.1 * torch.randn_like(x) + shift, self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--kill-in-epoch-end", type=int, default=-1)
    parser.add_argument("--rank0-save", action="store_true")
    parser.add_argument("--plateau", action="store_true")
    parser.add_argument("--data-seed", type=int, default=0)
    args = parser.parse_args()
    epochs = 8 if args.plateau else EPOCHS

    run = ddpkit.Run(
        out=args.out, global_batch=12, micro_batch=args.micro_batch, save_every=2, log_every=1,
        progress=False,
    )  # fmt: skip
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2))
    net[1].requires_grad_(False)
    model = run.setup(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = run.loader(Flips(60, seed=args.data_seed), num_workers=2)
    total = epochs * len(loader)  # the schedule's length, as on one device
    # Linear warm-up and decay, HF's get_linear_schedule_with_warmup written out: the length lives
    # in the closure, not in the scheduler's state_dict, so a resume keeps whatever len() said.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 3) * max(0.0, (total - step) / total)
    )
    if args.plateau:  # stepped after each epoch with the validation accuracy instead
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
    ema = torch.optim.swa_utils.AveragedModel(
        ddpkit.unwrap(model), multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    loop = {"best": 0.0, "bad_epochs": 0, "validations": 0}
    run.track(optimizer, scheduler, ema=ema, loop=loop)
    held_out = Flips(30, seed=1)
    held_out = TensorDataset(held_out.x, held_out.y)

    for epoch in range(loader.epoch, epochs):
        if epoch == 1:
            net[1].requires_grad_(True)
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            run.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            optimizer.step()
            if not args.plateau:
                scheduler.step()
            ema.update_parameters(model)
            if run.step == args.kill_at and run.rank == 0 and run.at_step_end:
                os.kill(os.getpid(), signal.SIGKILL)
        accuracy = run.evaluate(
            held_out, lambda batch: (model(batch[0]).argmax(1) == batch[1]).float().mean()
        )
        run.log(val_acc=accuracy["value"])
        if args.plateau:
            scheduler.step(accuracy["value"])
        if epoch == args.kill_in_epoch_end and run.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        better = accuracy["value"] > loop["best"]
        loop["best"], loop["bad_epochs"] = (
            max(loop["best"], accuracy["value"]),
            0 if better else loop["bad_epochs"] + 1,
        )
        loop["validations"] += 1
        if args.rank0_save and run.rank == 0:
            run.save()
        if args.plateau and loop["bad_epochs"] >= 2:
            break  # early stopping
    if run.is_main:
        torch.save({"ema": ema.state_dict(), "loop": loop}, os.path.join(args.out, "extras.pt"))
    run.finish()


if __name__ == "__main__":
    main()
