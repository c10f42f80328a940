"""The training loop every rank runs: shard the data, step the model, log on rank 0."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from ddpkit.dist import DistEnv
from ddpkit.train.config import TrainConfig, check_split
from ddpkit.train.metrics import MetricsLog, plot_loss
from ddpkit.train.schedule import warmup_cosine
from ddpkit.train.workloads import Job

log = logging.getLogger(__name__)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW that decays matrices only: biases and norm gains are not pulled towards zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


class Trainer:
    """Trains ``job.model`` wrapped in DistributedDataParallel for ``cfg.steps`` steps.

    Args:
        job: model, dataset and loss of the workload.
        cfg: the run's configuration, with the workload defaults filled in.
        env: this process's distributed environment.
    """

    def __init__(self, job: Job, cfg: TrainConfig, env: DistEnv) -> None:
        check_split(cfg.global_batch, env.world_size)
        self.job, self.cfg, self.env = job, cfg, env
        model = job.model.to(env.device)
        # DDP broadcasts rank 0's parameters here, so every replica starts identical.
        self.model = DistributedDataParallel(
            model, device_ids=[env.local_rank] if env.device.type == "cuda" else None
        )
        self.optimizer = make_optimizer(self.model, cfg.lr)
        self.sampler = DistributedSampler(
            job.dataset,
            num_replicas=env.world_size,
            rank=env.rank,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        self.loader = DataLoader(
            job.dataset, batch_size=cfg.global_batch // env.world_size, sampler=self.sampler, drop_last=True
        )
        self.out = Path(cfg.out)
        self.metrics = MetricsLog(self.out / "metrics.jsonl") if env.is_rank0 else None
        self.records: list[dict] = []

    def _batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        epoch = 0
        while True:
            # Without set_epoch every epoch would replay the same order: the seeds' classic bug.
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def _run_batch(self, x: Tensor, y: Tensor, lr: float) -> Tensor:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = x.to(self.env.device, non_blocking=True), y.to(self.env.device, non_blocking=True)
        loss = self.job.loss_fn(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces gradient buckets while backward runs
        if self.cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        return loss.detach()

    def fit(self) -> list[dict]:
        """Run all steps; returns the logged records (on every rank)."""
        cfg = self.cfg
        bar = tqdm(total=cfg.steps, disable=not self.env.is_rank0, unit="step", dynamic_ncols=True)
        window_loss, window_steps, window_start = torch.zeros(()), 0, time.perf_counter()
        for step, (x, y) in zip(range(1, cfg.steps + 1), self._batches(), strict=False):
            lr = warmup_cosine(step, cfg.lr, cfg.warmup_steps, cfg.steps)
            window_loss += self._run_batch(x, y, lr).cpu()
            window_steps += 1
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.steps:
                record = self._log(step, lr, window_loss / window_steps, window_steps, window_start)
                bar.set_postfix(loss=f"{record['loss']:.3f}", samples_per_s=f"{record['samples_per_s']:.0f}")
                window_loss, window_steps, window_start = torch.zeros(()), 0, time.perf_counter()
        bar.close()
        return self.records

    def _log(self, step: int, lr: float, mean_loss: Tensor, steps: int, start: float) -> dict:
        # Every rank reaches this step, so the all-reduce is matched: the logged loss is the global mean.
        loss = mean_loss.to(self.env.device).clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        elapsed = time.perf_counter() - start
        record = {
            "step": step,
            "loss": loss.item() / self.env.world_size,
            "samples_per_s": steps * self.cfg.global_batch / elapsed,
            "lr": lr,
            "time_s": elapsed,
        }
        self.records.append(record)
        if self.metrics is not None:
            self.metrics.write(record)
        return record

    def finish(self) -> str | None:
        """On rank 0: save the model and the loss curve, and run the workload's finish (a GPT sample)."""
        if not self.env.is_rank0:
            return None
        module = self.model.module
        save_state_dict(module.state_dict(), self.out / "model.pt")
        plot_loss(self.records, self.out / "loss.png", title=f"{self.cfg.workload}: training loss")
        return self.job.finish(module) if self.job.finish else None


def save_state_dict(state: dict, path: Path) -> None:
    """Write atomically: a crash mid-write leaves the old file, never a truncated one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({k: v.detach().cpu() for k, v in state.items()}, tmp)
    tmp.replace(path)
