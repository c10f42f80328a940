"""The entry point each training process runs: ``python -m ddpkit.train.worker OUT/config.json``.

``ddpkit train`` starts it through torchrun's elastic agent; ``@record`` writes a failing rank's
traceback where the agent finds it, so the launcher can say which rank failed and why.
"""

from __future__ import annotations

import random
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from ddpkit.checkpoint.files import save_weights
from ddpkit.checkpoint.lock import OutLock
from ddpkit.dist import DistEnv, destroy, init_distributed
from ddpkit.dist.init import DEFAULT_TIMEOUT
from ddpkit.launch.orphans import die_with_parent
from ddpkit.logs import setup_logging
from ddpkit.train.config import TrainConfig
from ddpkit.train.metrics import plot_loss
from ddpkit.train.trainer import Trainer
from ddpkit.train.workloads import Job, get_workload


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical model init, and the engine's broadcast then changes nothing."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: TrainConfig) -> None:
    """Join the process group, train, and on rank 0 write the model and report."""
    # The backend's own timeout comes after the hang report, which explains what it would not.
    timeout = timedelta(seconds=cfg.collective_timeout + 120) if cfg.collective_timeout else DEFAULT_TIMEOUT
    env = init_distributed(cfg.backend, timeout=timeout)
    setup_logging(env)
    if env.restart_count > 0 or has_checkpoints(cfg):
        # The elastic agent restarted us (after a failure, or for a membership change, which it
        # does not count as a restart); the launcher made sure --out was fresh when the job began,
        # so any checkpoint there is this run's: continue from the newest good one.
        cfg = cfg.replace(resume="auto")
    # One run per --out: global rank 0 holds the folder's lock until it exits (the kernel drops
    # it if the process dies), so a second run on the same folder stops at once.
    lock = OutLock(Path(cfg.out)).acquire() if env.is_rank0 else None
    try:
        seed_everything(cfg.seed)
        job = get_workload(cfg.workload).build(cfg)
        trainer = Trainer(job.model, job.dataset, job.loss_fn, env, cfg, eval_dataset=job.eval_dataset)
        records = trainer.fit()
        if env.is_rank0:
            finish(cfg, job, trainer.model.module, records, env)
    finally:
        if lock is not None:
            lock.release()
        destroy()


def has_checkpoints(cfg: TrainConfig) -> bool:
    folder = Path(cfg.out) / "checkpoints"
    return folder.is_dir() and any(folder.glob("step-*"))


def finish(cfg: TrainConfig, job: Job, model: torch.nn.Module, records: list[dict], env: DistEnv) -> None:
    """Rank 0: write model.pt and loss.png, print the summary and the workload's sample."""
    out = Path(cfg.out)
    save_weights(model.state_dict(), out / "model.pt")
    logged = [r for r in records if "loss" in r]
    if logged:
        plot_loss(logged, out / "loss.png", title=f"{cfg.workload}: training loss")
        print(
            f"ddpkit: {cfg.workload} trained to step {logged[-1]['step']} on {env.world_size} processes "
            f"({env.backend}); loss {logged[0]['loss']:.3f} -> {logged[-1]['loss']:.3f}; "
            f"wrote {out / 'model.pt'}",
            flush=True,
        )
    text = job.finish(model) if job.finish else None
    if text is not None:
        print(f"--- sample ---\n{text}\n--------------", flush=True)
        (out / "sample.txt").write_text(text, encoding="utf-8")


@record
def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    cfg = TrainConfig.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    train(cfg)


if __name__ == "__main__":
    main()
