"""A sharded run (fsdp, 2 processes) that checkpoints every 2 steps, and its rerun: what
tests/checkpoint/test_checkpoint_shared_verify.py launches, and the bytes each rank hashes doing it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.checkpoint.files import hashed_bytes, mapped_bytes


def _run(out: str, steps: int) -> ddpkit.Run:
    return ddpkit.Run(
        out=out, global_batch=8, engine="fsdp", save_every=2, keep_last=3, steps=steps, progress=False
    )


def train(out: str, steps: int) -> int:
    """Train to ``steps`` (resuming when OUT has checkpoints); the step the loop's first batch
    opened, which tells which checkpoint the run resumed from."""
    run = _run(out, steps)
    torch.manual_seed(0)
    model = run.setup(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    data = TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(1)), torch.randn(64, 1))
    first = None
    for x, y in run.loader(data):
        first = run.step if first is None else first
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
    run.finish()
    return first


def hashed_training(out: str, steps: int) -> int:
    """The bytes this rank hashed while ``train`` ran (every digest is counted)."""
    before = hashed_bytes()
    train(out, steps)
    return hashed_bytes() - before


def hashed_resuming(out: str, steps: int) -> int:
    """The bytes this rank hashed while a Run chose and verified the checkpoint it resumes from."""
    before = hashed_bytes()
    run = _run(out, steps)
    hashed = hashed_bytes() - before
    run.close()
    return hashed


def rchar() -> int:
    """Bytes this process has read from files: through read calls (Linux ``/proc/self/io``), and
    the checkpoint files hashed through a mapping, whose pages read calls do not see."""
    with open("/proc/self/io", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:")) + mapped_bytes()


def read_resuming(out: str, steps: int, wide: int) -> tuple[int, int]:
    """Train a model ``wide`` units wide with AdamW to ``steps`` through DCP (fsdp); rerun, the
    bytes this rank read from ``Run()`` to the end of the loop's first batch (checkpoint chosen,
    verified, the model loaded at setup, the optimizer at the first batch), and the optimizer
    steps taken other than the loop's own."""
    import torch.distributed.checkpoint  # noqa: F401  its modules' files are not the checkpoint's
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    before, read = rchar(), None
    run = ddpkit.Run(out=out, global_batch=8, engine="fsdp", save_every=2, steps=steps, progress=False)
    torch.manual_seed(0)
    model = run.setup(nn.Sequential(nn.Linear(wide, 4 * wide), nn.Tanh(), nn.Linear(4 * wide, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    taken = [0]
    optimizer.register_step_pre_hook(lambda *_: taken.__setitem__(0, taken[0] + 1))
    run.track(optimizer)
    data = TensorDataset(torch.randn(32, wide), torch.randn(32, 1))
    for x, y in run.loader(data):
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
        taken[0] -= 1
        read = rchar() - before if read is None else read
    run.finish()
    return read, taken[0]
