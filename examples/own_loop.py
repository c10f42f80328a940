"""The DDP tutorials' multigpu.py Trainer (model, dataset, _run_batch, _run_epoch, save) on ddpkit.Run.

    ddpkit run --nproc 2 examples/own_loop.py --out runs/own_loop --save-every 10

Compared with the single-device script, the Trainer changes in three lines (``run.backward``,
the loader and ``range(loader.epoch, ...)``) and main() in five; docs/own-script.md shows the
diff. The run is checkpointed every --save-every steps and resumes exactly after a kill
(``--resume`` is ``auto`` by default), on any number of processes. At the end it checks that
the loss fell and that ``run.evaluate``'s exact mean over uneven shards equals one process's
mean over the whole split.
"""

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ddpkit


class MyTrainDataset(Dataset):
    """The DDP tutorials' random regression data, with a random augmentation drawn at every fetch."""

    def __init__(self, size: int, noise: float) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.data = [(torch.rand(20, generator=gen), torch.rand(1, generator=gen)) for _ in range(size)]
        self.noise = noise

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[index]
        return x + self.noise * torch.randn(20), y


class Trainer:
    """The DDP tutorials' Trainer: the same methods, the same loop."""

    def __init__(self, run: ddpkit.Run, model, train_data, optimizer, scheduler) -> None:
        self.run, self.model, self.train_data = run, model, train_data
        self.optimizer, self.scheduler = optimizer, scheduler

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        self.run.backward(loss)
        self.optimizer.step()
        self.scheduler.step()

    def _run_epoch(self, epoch: int) -> None:
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.train_data.epoch, max_epochs):
            self._run_epoch(epoch)


def load_train_objs(args) -> tuple:
    train_set = MyTrainDataset(args.size, args.noise)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(64, 1))
    return train_set, model


def main(args) -> None:
    run = ddpkit.Run(
        out=args.out, global_batch=args.global_batch, micro_batch=args.micro_batch,
        save_every=args.save_every,
        steps=args.steps, engine=args.engine, log_every=1, log_samples=args.log_samples, progress=False,
        invariant_dropout=True,  # the dropout masks drawn per sample: the same run on any world size
    )  # fmt: skip
    dataset, model = load_train_objs(args)
    untrained = copy.deepcopy(model)  # run.setup loads a resumed run's weights into model
    model = run.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    run.track(optimizer=optimizer, scheduler=scheduler)
    train_data = run.loader(dataset, num_workers=args.num_workers, persistent_workers=args.num_workers > 0)
    Trainer(run, model, train_data, optimizer, scheduler).train(args.epochs)
    held_out = MyTrainDataset(args.size, noise=0.0)  # the same samples, without augmentation
    check(run, model, held_out, mse_alone(untrained.to(run.device), held_out, run.device))
    run.finish()


def mse_alone(model: nn.Module, dataset: Dataset, device: torch.device) -> float:
    """One process's mean squared error over the whole split, in one batch."""
    model.eval()
    with torch.no_grad():
        xs, ys = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
        mse = F.mse_loss(model(torch.stack(xs).to(device)), torch.stack(ys).to(device)).item()
    model.train()
    return mse


def check(run: ddpkit.Run, model: nn.Module, dataset: Dataset, before: float) -> None:
    """The loss fell, and the exact distributed mean equals one process's mean over the split."""
    exact = run.evaluate(dataset, lambda batch: F.mse_loss(model(batch[0]), batch[1]), batch_size=7)
    alone = mse_alone(model.module, dataset, run.device)
    assert exact["samples"] == len(dataset), f"evaluated {exact['samples']} of {len(dataset)} samples"
    assert abs(exact["value"] - alone) <= 1e-5 * alone, (
        f"distributed mean {exact['value']} != one process's {alone}"
    )
    assert exact["value"] < before, f"the loss did not fall: {before} -> {exact['value']}"
    run.print(
        f"own_loop: step {run.step} on {run.env.world_size} processes; "
        f"mse {before:.4f} -> {exact['value']:.4f}"
    )


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="run folder (none: no files, no checkpoints)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--noise", type=float, default=0.01)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--log-samples", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
