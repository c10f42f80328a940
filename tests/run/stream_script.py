"""A loop over streaming data on ddpkit.Run, for tests/run/test_run_stream.py.

Sources (--source): ``hf``, a HuggingFace ``datasets`` IterableDataset built in memory (4 shards,
state_dict); ``plain``, a generator-backed IterableDataset without state; ``shards``, a
``ddpkit.data.Shards`` source of 6 uneven shards. --kill-at STEP: rank 0 SIGKILLs itself after it.
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset

import ddpkit
from ddpkit.data import Shards

EPOCHS = 2


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(100, 4, generator=gen), torch.randn(100, 1, generator=gen)


class Plain(IterableDataset):
    def __iter__(self):
        x, y = _tables()
        yield from zip(x, y, strict=True)


def source(kind: str):
    x, y = _tables()
    if kind == "hf":
        import datasets

        table = datasets.Dataset.from_dict({"x": x.tolist(), "y": y.tolist()})
        return table.to_iterable_dataset(num_shards=4).with_format("torch")
    if kind == "plain":
        return Plain()
    sizes = [10, 25, 5, 20, 30, 10]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return Shards(
        list(zip(starts, sizes, strict=True)),
        read=lambda s: list(zip(x[s[0] : s[0] + s[1]], y[s[0] : s[0] + s[1]], strict=True)),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()
    run = ddpkit.Run(out=args.out, global_batch=12, micro_batch=2, log_every=1, progress=False, save_every=4)
    torch.manual_seed(0)
    model = run.setup(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run.track(optimizer)
    loader = run.loader(source(args.source), num_workers=args.workers)
    for _ in range(loader.epoch, EPOCHS):
        for batch in loader:
            x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            if run.step == args.kill_at and run.rank == 0 and run.at_step_end:
                os.kill(os.getpid(), signal.SIGKILL)
    run.finish()


if __name__ == "__main__":
    main()
