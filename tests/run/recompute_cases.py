"""A GPT with dropout trained with and without activation checkpointing of its blocks, on the
torch and fsdp engines, plain and keyed dropout: what tests/run/test_run_recompute.py launches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.models.gpt import GPT, GPTConfig


def losses(engine: str, keyed: bool, recompute: bool) -> list[float]:
    options = {"checkpoint_modules": ["Block"]} if recompute else {}
    run = ddpkit.Run(
        global_batch=8, micro_batch=2, engine=engine, invariant_dropout=keyed, progress=False, **options
    )
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.2))
    model = run.setup(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run.track(optimizer)
    tokens = torch.randint(0, 32, (32, 17), generator=torch.Generator().manual_seed(1))
    out = []
    for x, y in run.loader(TensorDataset(tokens[:, :-1], tokens[:, 1:])):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        run.backward(loss)
        optimizer.step()
        out.append(loss.item())
    run.finish()
    return out


def every_case() -> dict:
    return {
        (engine, keyed, recompute): losses(engine, keyed, recompute)
        for engine in ("torch", "fsdp")
        for keyed in (False, True)
        for recompute in (False, True)
    }
