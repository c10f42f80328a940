"""A 2-layer GPT trained under torch.compile (inductor) on ddpkit.Run, compiled before or after
``run.setup``. tests/run/test_run_compile.py runs it in-process on every engine and as a command
that is killed and run again.

Flags: --out, --engine, --order (before | after | eager), --kill-at STEP (rank 0 SIGKILLs itself
after that step).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.models.gpt import GPT, GPTConfig

VOCAB, BLOCK = 32, 16


def train(engine: str, order: str, out: str | None = None, kill_at: int = 0) -> dict:
    """Losses, and the graphs and breaks torch.compile made, for one run of 3 epochs of 4 steps."""
    torch._dynamo.reset()
    counters.clear()
    saves = {"save_every": 2, "log_every": 1} if out else {}
    run = ddpkit.Run(out=out, global_batch=8, engine=engine, progress=False, **saves)
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    if order == "before":
        model = run.setup(torch.compile(net))
    elif order == "after":
        model = torch.compile(run.setup(net))
    else:
        model = run.setup(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run.track(optimizer)
    tokens = torch.randint(0, VOCAB, (32, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    loader = run.loader(TensorDataset(tokens[:, :-1], tokens[:, 1:]))
    losses = []
    for _ in range(loader.epoch, 3):
        for x, y in loader:
            loss = F.cross_entropy(model(x).view(-1, VOCAB), y.reshape(-1))
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            losses.append(loss.item())
            if run.step == kill_at and run.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    run.finish()
    breaks = sum(counters["graph_break"].values())
    return {"losses": losses, "graphs": counters["stats"]["unique_graphs"], "breaks": breaks}


def sequential_graphs(engine: str) -> int:
    """Graphs made for an nn.Sequential of torch's layers compiled after setup (dynamo skips
    the frames of torch's own files when they are called from a frame it does not trace)."""
    torch._dynamo.reset()
    counters.clear()
    run = ddpkit.Run(global_batch=8, engine=engine, progress=False)
    model = torch.compile(run.setup(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    for (x,) in run.loader(TensorDataset(torch.randn(16, 4))):
        optimizer.zero_grad()
        run.backward(model(x).square().mean())
        optimizer.step()
    run.finish()
    return counters["stats"]["unique_graphs"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", default="native")
    parser.add_argument("--order", default="after")
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()
    train(args.engine, args.order, args.out, args.kill_at)


if __name__ == "__main__":
    main()
