"""A plain PyTorch Lightning script, written for torchrun: no ddpkit in it.

    torchrun --nproc-per-node 2 lightning_client_script.py OUT [DEVICES] [MAX_STEPS]

After ``trainer.fit`` every rank writes ``OUT/rank{global_rank}.json`` (what it saw: its ranks,
pid, the launcher's environment variables, the cluster environment Lightning chose) and
``OUT/rank{global_rank}.pt`` (its final state_dict; ``OUT/initial_rank{global_rank}.pt`` the one
before training). tests/outside/test_lightning_client.py runs
it under ``ddpkit run`` and under torchrun and compares the two from the outside.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# What the launcher sets; recorded as each worker saw it before Lightning touched anything.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


class MLP(lightning.LightningModule):
    def __init__(self, dim: int = 8, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, classes)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, dim), (B,)
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def make_dataset(n: int = 256, dim: int = 8, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)  # the same samples in every process
    x = torch.randn(n, dim, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def main() -> None:
    out = Path(sys.argv[1])
    devices = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    max_steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    seen_env = {name: os.environ.get(name) for name in LAUNCHER_VARS}

    lightning.seed_everything(0)
    model = MLP()
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    # shuffle=True: Lightning replaces the RandomSampler with a shuffling DistributedSampler.
    loader = DataLoader(make_dataset(), batch_size=16, shuffle=True)
    trainer = lightning.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=devices,
        num_nodes=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)

    rank = trainer.global_rank
    out.mkdir(parents=True, exist_ok=True)
    torch.save(initial, out / f"initial_rank{rank}.pt")
    torch.save(model.state_dict(), out / f"rank{rank}.pt")
    seen = {
        "global_rank": rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "env": seen_env,
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        "creates_processes_externally": trainer.strategy.cluster_environment.creates_processes_externally,
        "global_step": trainer.global_step,
        "sampler": type(trainer.train_dataloader.sampler).__name__,
        "num_threads": torch.get_num_threads(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
