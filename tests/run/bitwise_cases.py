"""What tests/run/test_run_bitwise.py launches: a GPT with keyed dropout and a token loss with
``count=`` (ignored positions), trained with ``ddpkit.Run(bitwise=True)``; each rank returns the
step losses it logged and its final weights."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.models import GPT, GPTConfig

IGNORE = -100


def dataset() -> TensorDataset:
    """64 sequences of 17 tokens, a quarter of the targets ignored (a padded batch's labels)."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (64, 17), generator=gen)
    targets = tokens[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=gen) < 0.25] = IGNORE
    return TensorDataset(tokens[:, :-1], targets)


def train(
    out: str,
    steps: int,
    engine: str = "torch",
    die_at: int | None = None,
    bitwise: bool = True,
    loss_kind: str = "count",
    **options,
) -> dict:
    """Train a small GPT (dropout 0.1, keyed) with AdamW for ``steps`` steps of 16 sequences cut
    into 8 grains (``bitwise=False``: the default mode; ``loss_kind="sum"``: the token loss as a
    ``reduction="sum"`` backward instead of ``count=``); ``die_at``: the process exits at once
    when that step opens (a kill: no checkpoint, no goodbye), after the checkpoint of every 3rd
    step."""
    run = ddpkit.Run(
        out=out,
        steps=steps,
        global_batch=16,
        drop_last=True,
        bitwise=bitwise,
        engine=engine,
        invariant_dropout=True,
        save_every=3,
        log_every=1,
        progress=False,
        **options,
    )
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    model = run.setup(GPT(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run.track(optimizer)
    loader = run.loader(dataset())
    threads = None
    for _ in range(loader.epoch, 10):
        for x, y in loader:
            if run.step == die_at:
                os._exit(17)
            threads = torch.get_num_threads()
            if bitwise:
                assert run.micro_batch == 2 and len(x) == 2  # the grain: 16 / 8
            logits = model(x)
            loss = F.cross_entropy(
                logits.reshape(-1, 64), y.reshape(-1), ignore_index=IGNORE, reduction="sum"
            )
            optimizer.zero_grad()
            if loss_kind == "count":
                run.backward(loss, count=(y != IGNORE).sum())
            else:  # a summed loss: per step, the sum over the global batch
                run.backward(loss / 16, reduction="sum")
            run.log(acc=(logits.argmax(-1) == y).float().mean(), tokens=(y != IGNORE).sum().item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    run.finish()
    weights = {k: v.detach().clone() for k, v in ddpkit.unwrap(model).state_dict().items()}
    return {"weights": weights, "threads": threads}


def two_backwards(out: str) -> None:
    """A loop that runs two backwards in one micro-batch: refused in one line."""
    run = ddpkit.Run(out=out, steps=2, global_batch=16, bitwise=True, progress=False)
    model = run.setup(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    try:
        for x, y in run.loader(data):
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            run.backward(F.l1_loss(model(x), y))
            optimizer.step()
    finally:
        run.close()


def refused(options: dict, loader_options: dict | None = None, stream: bool = False) -> str:
    """The one line a bitwise Run with ``options`` (or its loader) refuses with; '' when none."""
    try:
        run = ddpkit.Run(progress=False, bitwise=True, **options)
        try:
            model = run.setup(torch.nn.Linear(4, 1))
            data = TensorDataset(torch.randn(36, 4), torch.randn(36, 1))
            if stream:
                from torch.utils.data import IterableDataset

                class Stream(IterableDataset):
                    def __iter__(self):
                        return iter(data)

                data = Stream()
            loader = run.loader(data, **(loader_options or {}))
            for x, _ in loader:
                run.all_gather(model(x))
        finally:
            run.close()
    except ddpkit.ConfigError as exc:
        return str(exc)
    return ""


def resumed_with(out: str, grains: int) -> str:
    """The line a bitwise Run over ``out`` with ``grains`` gives at its loader ('' when none)."""
    run = ddpkit.Run(out=out, global_batch=16, drop_last=True, bitwise=True, grains=grains, progress=False)
    try:
        model = run.setup(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)))
        run.track(torch.optim.AdamW(model.parameters(), lr=3e-3))
        run.loader(dataset())
    except ddpkit.ConfigError as exc:
        return str(exc)
    finally:
        run.close()
    return ""


def threads_changed(out: str) -> None:
    """A bitwise loop that sets its own thread count after Run(): one line says the bits follow it."""
    run = ddpkit.Run(out=out, steps=1, global_batch=16, bitwise=True, progress=False)
    model = run.setup(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    torch.set_num_threads(2)
    for x, y in run.loader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1))):
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
    run.finish()
