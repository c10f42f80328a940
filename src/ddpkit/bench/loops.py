"""The training loops ``ddpkit bench trainer`` times side by side, each over its own copy of one model.

- ``HandLoop``: the DDP tutorials' hand-written loop: torch's DataLoader with a DistributedSampler,
  ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``; in a world of one, the plain
  single-process loop (no DDP: what ``python train.py`` runs before it is ported).
- ``RunLoop``: the same loop on ``ddpkit.Run`` with every default diagnostic on (hang watchdog,
  per-rank timings, metrics.jsonl, replica fingerprints, non-finite check).

Both use the same AdamW, the same warmup-cosine learning rate and the same clipping, so they do
the same arithmetic (bf16 autocast and ``torch.compile`` for both when asked); each ``run(steps)``
times whole steps, data loading included. A step's time is read at its end without a device
sync: on a GPU the loops are timed over whole blocks (``time``), whose last step syncs.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ddpkit
from ddpkit.train.schedule import warmup_cosine
from ddpkit.train.trainer import make_optimizer


class SlowData(Dataset):
    """A dataset whose every sample costs ``ms`` milliseconds of CPU, like decoding an image."""

    def __init__(self, dataset: Dataset, ms: float) -> None:
        self.dataset, self.seconds = dataset, ms / 1000

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        end = time.process_time() + self.seconds
        while time.process_time() < end:
            pass
        return self.dataset[index]


def _lr_factor(cfg):
    return lambda step: warmup_cosine(step + 1, 1.0, cfg.warmup_steps, cfg.steps)


class HandLoop:
    """The tutorial loop, with the same schedule and clipping as the others."""

    def __init__(self, job, dataset: Dataset, cfg, env, num_workers: int) -> None:
        self.cfg, self.loss_fn, self.device = cfg, job.loss_fn, env.device
        bare = copy.deepcopy(job.model).to(env.device)
        self.model = DistributedDataParallel(bare) if env.world_size > 1 else bare
        if cfg.compile:
            self.model = torch.compile(self.model)
        # The tutorial's bf16: autocast around the forward and the loss, fp32 weights.
        self.autocast = torch.autocast(env.device.type, torch.bfloat16, enabled=cfg.precision == "bf16")
        self.optimizer = make_optimizer(bare, cfg.lr, cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_factor(cfg))
        self.sampler = DistributedSampler(dataset, env.world_size, env.rank, shuffle=True, seed=cfg.seed)
        # torch's defaults otherwise, which are also run.loader's: workers restart each epoch,
        # each keeps 2 batches in flight.
        self.loader = DataLoader(
            dataset,
            batch_size=cfg.global_batch // env.world_size,
            sampler=self.sampler,
            num_workers=num_workers,
        )
        self.batches = iter(self.loader)
        self.epoch, self.times = 0, []

    def _next_batch(self):
        try:
            return next(self.batches)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self.batches = iter(self.loader)
            return next(self.batches)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            x, y = (t.to(self.device, non_blocking=True) for t in self._next_batch())
            with self.autocast:
                loss = self.loss_fn(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.times.append(time.perf_counter() - start)
        block_end(self.device, self.times)


def block_end(device: torch.device, times: list[float]) -> None:
    """On a GPU, wait for the block's kernels and count the wait in its last step."""
    if device.type == "cuda":
        start = time.perf_counter()
        torch.cuda.synchronize(device)
        times[-1] += time.perf_counter() - start


class RunLoop:
    """The same loop on ddpkit.Run, as a user would write it (defaults on, metrics to ``out``)."""

    def __init__(self, job, dataset: Dataset, cfg, out: str, num_workers: int) -> None:
        self.loss_fn = job.loss_fn
        self.ddpkit_run = ddpkit.Run(
            out=out,
            global_batch=cfg.global_batch,
            grad_clip=cfg.grad_clip,
            progress=False,
            precision=cfg.precision,
        )
        model = copy.deepcopy(job.model)
        self.optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay)
        self.model = self.ddpkit_run.setup(model, self.optimizer)
        if cfg.compile:
            self.model = torch.compile(self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_factor(cfg))
        self.ddpkit_run.track(self.scheduler)
        self.loader = self.ddpkit_run.loader(dataset, num_workers=num_workers)
        self.batches = iter(self.loader)
        self.times = []

    def _next_batch(self):
        try:
            return next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)  # the loader moves to the next epoch by itself
            return next(self.batches)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            x, y = self._next_batch()
            loss = self.loss_fn(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            self.ddpkit_run.backward(loss)
            self.optimizer.step()
            self.scheduler.step()
            self.times.append(time.perf_counter() - start)
        block_end(self.ddpkit_run.device, self.times)

    def close(self) -> None:
        self.ddpkit_run.finish()
