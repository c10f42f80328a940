"""The entry point each training process runs: ``python -m ddpkit.train.worker OUT/config.json``.

``ddpkit train`` starts it through torchrun's elastic agent; ``@record`` writes a failing rank's
traceback where the agent finds it, so the launcher can say which rank failed and why.
"""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from ddpkit.dist import destroy, init_distributed
from ddpkit.train.config import TrainConfig
from ddpkit.train.trainer import Trainer
from ddpkit.train.workloads import get_workload

log = logging.getLogger("ddpkit.train")


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical model init, and DDP's broadcast then changes nothing."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: TrainConfig) -> None:
    """Join the process group, train, and on rank 0 write the model and report."""
    env = init_distributed(cfg.backend)
    try:
        seed_everything(cfg.seed)
        trainer = Trainer(get_workload(cfg.workload).build(cfg), cfg, env)
        records = trainer.fit()
        text = trainer.finish()
        if env.is_rank0:
            first, last = records[0]["loss"], records[-1]["loss"]
            print(
                f"ddpkit: {cfg.workload} trained {cfg.steps} steps on {env.world_size} processes "
                f"({env.backend}); loss {first:.3f} -> {last:.3f}; wrote {Path(cfg.out) / 'model.pt'}",
                flush=True,
            )
            if text is not None:
                print(f"--- sample ---\n{text}\n--------------", flush=True)
                (Path(cfg.out) / "sample.txt").write_text(text, encoding="utf-8")
    finally:
        destroy()


@record
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = TrainConfig.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    train(cfg)


if __name__ == "__main__":
    main()
