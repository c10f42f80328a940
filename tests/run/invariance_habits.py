"""Habits of real models and loops, each a small single-device loop ported to ddpkit.Run, for
tests/run/test_run_invariance.py (issue 32). ``train_all`` runs every habit, one Run each, in
one process, so one launch covers every habit at a world size.

Every habit's data (19 samples, global batch 6, no shuffle) ends each epoch with a batch of one
sample, which leaves all ranks but one empty: their stand-in sample must count for nothing in
the loss, the counts and the logged values.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

N, GLOBAL_BATCH, EPOCHS, T = 19, 6, 2, 50
HABITS = ("dropout", "diffusion", "sum", "tokens", "weighted", "infonce", "gan", "gan_freeze", "bf16")


class DropPath(nn.Module):
    """timm's stochastic depth, written out: a whole sample's branch dropped with drop_prob."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0:
            return x
        keep = x.new_empty(x.shape[0], *[1] * (x.dim() - 1)).bernoulli_(1 - self.drop_prob)
        return x * keep / (1 - self.drop_prob)


class Net(nn.Module):
    """An MLP with dropout after the first layer and a stochastic-depth residual branch."""

    def __init__(self, inputs: int = 6, outputs: int = 3, extra: int = 0) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs + extra, 16)
        self.drop = nn.Dropout(0.2)
        self.branch = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.path = DropPath(0.3)
        self.out = nn.Linear(16, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.inp(x)))  # (B, 16)
        return self.out(h + self.path(self.branch(h)))


class NoisyHeldOut(torch.utils.data.Dataset):
    """A validation split that adds noise from a generator of its own, as augmenting ones do."""

    def __init__(self) -> None:
        self.x = torch.randn(13, 6, generator=torch.Generator().manual_seed(5))
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + float(self.rng.normal(scale=0.3)), i % 3


def data(habit: str) -> TensorDataset:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(N, 6, generator=gen)
    if habit == "tokens":  # sequences of 4 tokens, padded (-100) after a random length
        y = torch.randint(0, 3, (N, 4), generator=gen)
        lengths = torch.randint(1, 5, (N,), generator=gen)
        y[torch.arange(4).unsqueeze(0) >= lengths.unsqueeze(1)] = -100
        return TensorDataset(x, y)
    if habit == "weighted":
        return TensorDataset(x, torch.randint(0, 3, (N,), generator=gen))
    return TensorDataset(x, (x[:, :3] > 0).long().sum(1) % 3)


def loss_of(habit: str, run: ddpkit.Run, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """The habit's loss and backward, as the single-device loop writes it (ddpkit's options added)."""
    if habit in ("dropout", "bf16"):
        out = model(x)
        run.backward(F.cross_entropy(out, y))
    elif habit == "diffusion":  # noise and timesteps drawn in the loop, per sample
        t = run.randint(T, like=x)  # (B,)
        alpha = torch.cos(t.float() / T * math.pi / 2).unsqueeze(1) ** 2  # (B, 1)
        noise = run.randn_like(x)
        noisy = alpha.sqrt() * x + (1 - alpha).sqrt() * noise
        run.backward(F.mse_loss(model(torch.cat([noisy, t.float().unsqueeze(1) / T], 1)), noise))
    elif habit == "sum":  # a summed loss, and the loop's own clip_grad_value_
        out = model(x)
        run.backward(F.cross_entropy(out, y, reduction="sum"), reduction="sum")
        nn.utils.clip_grad_value_(model.parameters(), 0.5)
    elif habit == "tokens":  # a mean over the tokens that are not padding
        out = model(x).unsqueeze(1).expand(-1, 4, -1) + torch.arange(4.0).view(1, 4, 1)  # (B, 4, 3)
        total = F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), ignore_index=-100, reduction="sum")
        run.backward(total, count=(y != -100).sum())
    elif habit == "weighted":  # class-weighted, normalised by the weights present
        weight = torch.tensor([1.0, 3.0, 0.5])
        total = F.cross_entropy(model(x), y, weight=weight, reduction="sum")
        run.backward(total, count=weight[y].sum())
    elif habit == "infonce":  # in-batch negatives over the global batch
        z1 = F.normalize(model(x), dim=1)
        z2 = F.normalize(model(x + 0.1 * run.randn_like(x)), dim=1)
        logits = z1 @ run.all_gather(z2).T / 0.5  # (B, global batch)
        labels = run.batch_offset + torch.arange(len(x))
        run.backward(F.cross_entropy(logits, labels))
    out = None if habit in ("diffusion", "tokens", "infonce") else model(x).detach()
    if out is not None:
        run.log(correct=(out.argmax(1) == y).sum(), reduce="sum")
        run.log(acc=(out.argmax(1) == y).float().mean())


def train(out: str, habit: str, micro_batch: int | None) -> dict:
    """One habit's run: its logged lines and final weights."""
    if habit.startswith("gan"):
        return train_gan(out, micro_batch, freeze=habit == "gan_freeze")
    run = ddpkit.Run(
        out=out, global_batch=GLOBAL_BATCH, micro_batch=micro_batch, shuffle=False, log_every=1,
        progress=False, invariant_dropout=True, seed=4, precision="bf16" if habit == "bf16" else "fp32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = run.setup(Net(extra=1 if habit == "diffusion" else 0, outputs=6 if habit == "diffusion" else 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run.track(optimizer)
    loader = run.loader(data(habit))
    try:
        for _ in range(loader.epoch, EPOCHS):
            for x, y in loader:
                optimizer.zero_grad()
                loss_of(habit, run, model, x, y)
                optimizer.step()
    except BaseException:
        run.close()
        raise
    weights = {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()}
    if habit == "dropout":  # twice: each evaluation draws the held-out noise alike
        score = lambda batch: F.cross_entropy(model(batch[0]), batch[1])  # noqa: E731
        weights["val"] = torch.tensor(
            [run.evaluate(NoisyHeldOut(), score, batch_size=4)["value"] for _ in range(2)]
        )
    run.finish()
    return {"weights": weights, "lines": ddpkit_lines(out)}


def train_gan(out: str, micro_batch: int | None, freeze: bool) -> dict:
    """A GAN whose generator steps every second step. ``freeze`` (porting.md's freezing of the
    discriminator before ``D(fake)``): the discriminator steps every step, before the generator's
    pass in the same iteration; otherwise the two alternate, the discriminator on odd steps."""
    run = ddpkit.Run(
        out=out, global_batch=GLOBAL_BATCH, micro_batch=micro_batch, shuffle=False, log_every=1,
        progress=False, seed=4, allow_unstepped=True,
    )  # fmt: skip
    torch.manual_seed(0)
    gen = run.setup(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6)), name="generator")
    disc = run.setup(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)), name="discriminator")
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05, momentum=0.9)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
    run.track(opt_g=opt_g, opt_d=opt_d)
    loader = run.loader(data("gan"))
    lines = _warnings()
    for _ in range(loader.epoch, EPOCHS):
        for real, _y in loader:
            fake = gen(run.randn_like(real))
            if freeze or run.step % 2 == 1:
                opt_d.zero_grad()
                scores = disc(torch.cat([real, fake.detach()]))  # (2B, 1)
                labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
                run.backward(F.binary_cross_entropy_with_logits(scores, labels))
                opt_d.step()
            if run.step % 2 == 0:
                if freeze:
                    disc.requires_grad_(False)
                opt_g.zero_grad()
                fooled = F.binary_cross_entropy_with_logits(disc(fake), torch.ones(len(real), 1))
                run.backward(fooled)
                opt_g.step()
                if freeze:
                    disc.requires_grad_(True)
    weights = {
        f"{name}.{k}": v.clone() for name in ("generator", "discriminator")
        for k, v in run._objects[name].state_dict().items()
    }  # fmt: skip
    run.finish()
    return {"weights": weights, "lines": ddpkit_lines(out), "warnings": lines}


def _warnings() -> list[str]:
    """The messages of ddpkit's warnings from here on, in this process."""
    import logging

    found: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found.append(record.getMessage())

    logging.getLogger("ddpkit").addHandler(Keep(logging.WARNING))
    return found


def ddpkit_lines(out: str) -> list[dict]:
    import json
    from pathlib import Path

    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def train_all(root: str, micro_batch: int | None, habits: tuple[str, ...] = HABITS) -> dict:
    """Every habit, one Run after another in this process: habit -> its result, or its error."""
    results = {}
    for habit in habits:
        try:
            results[habit] = train(f"{root}/{habit}", habit, micro_batch)
        except ddpkit.ConfigError as exc:
            results[habit] = {"error": str(exc)}
    return results
