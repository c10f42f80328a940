"""One ddpkit.Run loop, as a notebook cell holds it (tests/outside/test_notebook_launch.py).

The test reads this file as text: it is the source of a cell, so ``train`` is defined in the
kernel's ``__main__``, and ``ddpkit.launch(train, nproc=2, args=(out,))`` runs it; the same text
with ``train(sys.argv[1])`` added is the script that ``ddpkit run --nproc 2`` runs.

Every rank of every start appends ``{"rank", "first_step", "threads"}`` to OUT.starts.jsonl, so
the test can tell a resumed run from one that ran through, and see the thread counts agree.
"""

import json
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS = 3  # of 10 steps of 32 samples
SAVE_EVERY = 4


def make_dataset(n: int = 320, dim: int = 8, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)  # the same samples in every process
    x = torch.randn(n, dim, generator=g)  # (n, dim)
    teacher = torch.randn(dim, classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))  # learnable labels: the loss falls


def make_model(dim: int = 8, hidden: int = 32, classes: int = 3) -> torch.nn.Module:
    # Dropout draws from torch's generator: a resume is exact only if ddpkit restores it.
    return torch.nn.Sequential(
        torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(hidden, classes)
    )


def train(out: str, pause: float = 0.0, progress: bool = False) -> int:
    """The user's loop; ``pause`` seconds of sleep per step leave time to interrupt it."""
    run = ddpkit.Run(out=out, global_batch=32, save_every=SAVE_EVERY, log_every=1, progress=progress)
    model = run.setup(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run.track(optimizer)
    loader = run.loader(make_dataset())
    first_step = None
    for _ in range(loader.epoch, EPOCHS):
        for x, y in loader:
            if first_step is None:
                first_step = run.step
                record = {"rank": run.env.rank, "first_step": first_step, "threads": torch.get_num_threads()}
                with open(f"{out}.starts.jsonl", "a") as f:  # one short line: atomic under O_APPEND
                    f.write(json.dumps(record) + "\n")
            time.sleep(pause)
            loss = F.cross_entropy(model(x), y)  # (B, classes) against (B,)
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
    run.finish()
    return run.step
