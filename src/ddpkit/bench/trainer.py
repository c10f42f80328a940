"""`ddpkit bench trainer`: what the Trainer costs over a hand-written DDP loop, side by side in one run.

Both loops train their own copy of the same model on the same data with the same AdamW, schedule
and gradient clipping, alternating in blocks of steps so that machine noise hits both alike. The
hand-written loop is the seeds' loop: DataLoader + DistributedSampler, loss.backward(), step().
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import ddpkit
from ddpkit.errors import OneLineParser
from ddpkit.train import TrainConfig, Trainer
from ddpkit.train.callbacks import Callback
from ddpkit.train.schedule import warmup_cosine
from ddpkit.train.trainer import make_optimizer
from ddpkit.train.workloads import get_workload, with_defaults


class StepClock(Callback):
    """Records the duration of each Trainer step (from the previous step's end, or the block start)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.mark = time.perf_counter()

    def on_fit_start(self, trainer: Trainer) -> None:
        self.mark = time.perf_counter()

    def on_step_end(self, trainer: Trainer, step: int, indices: list[int]) -> None:
        now = time.perf_counter()
        self.times.append(now - self.mark)
        self.mark = now


class HandLoop:
    """The tutorial loop, with the Trainer's schedule and clipping so both do the same work."""

    def __init__(self, job, cfg: TrainConfig, env) -> None:
        self.cfg, self.loss_fn = cfg, job.loss_fn
        self.model = DistributedDataParallel(copy.deepcopy(job.model))
        self.optimizer = make_optimizer(self.model.module, cfg.lr, cfg.weight_decay)
        self.sampler = DistributedSampler(job.dataset, env.world_size, env.rank, shuffle=True, seed=cfg.seed)
        self.loader = DataLoader(
            job.dataset, batch_size=cfg.global_batch // env.world_size, sampler=self.sampler
        )
        self.batches = iter(self.loader)
        self.step, self.epoch, self.times = 0, 0, []

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
            self.step += 1
            for group in self.optimizer.param_groups:
                group["lr"] = warmup_cosine(self.step, self.cfg.lr, self.cfg.warmup_steps, self.cfg.steps)
            x, y = self._next_batch()
            loss = self.loss_fn(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.times.append(time.perf_counter() - start)


def _rank(workload: str, global_batch: int, blocks: int, block: int, out: str) -> dict:
    env = ddpkit.init_distributed("gloo")
    try:
        torch.manual_seed(0)
        cfg = with_defaults(
            TrainConfig(
                workload=workload, global_batch=global_batch, out=out, steps=blocks * block, log_every=10**9
            )
        )
        job = get_workload(workload).build(cfg)
        hand = HandLoop(job, cfg, env)
        clock = StepClock()
        trainer = Trainer(job.model, job.dataset, job.loss_fn, env, cfg, callbacks=[clock])
        trainer.callbacks = [clock]  # no progress bar or metrics file: time the loop itself
        for i in range(blocks):
            hand.run(block)
            trainer.total_steps = (i + 1) * block
            trainer.fit()
        return {"hand": hand.times[block:], "trainer": clock.times[block:]}  # first block: warm-up
    finally:
        ddpkit.destroy()


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="ddpkit bench trainer", description=__doc__.split("\n")[0])
    parser.add_argument("workload", nargs="?", default="gpt")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=8, help="alternations (the first is warm-up)")
    parser.add_argument("--block", type=int, default=10, help="steps per block")
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    with TemporaryDirectory(prefix="ddpkit-bench-") as out:
        ranks = ddpkit.launch(_rank, ns.nproc, (ns.workload, ns.global_batch, ns.blocks, ns.block, out))
    # A step takes as long as its slowest rank.
    hand = [max(times) for times in zip(*(r["hand"] for r in ranks), strict=True)]
    trainer = [max(times) for times in zip(*(r["trainer"] for r in ranks), strict=True)]
    result = {
        "workload": ns.workload,
        "nproc": ns.nproc,
        "global_batch": ns.global_batch,
        "steps": len(hand),
        "hand_median_ms": 1e3 * statistics.median(hand),
        "trainer_median_ms": 1e3 * statistics.median(trainer),
        "ratio": statistics.median(trainer) / statistics.median(hand),
    }
    print(
        f"# ddpkit bench trainer: {ns.workload}, {ns.nproc} processes, global batch {ns.global_batch}, "
        f"{len(hand)} timed steps each, alternating blocks of {ns.block}"
    )
    print(f"hand-written DDP loop  median {result['hand_median_ms']:8.2f} ms/step")
    print(f"ddpkit Trainer         median {result['trainer_median_ms']:8.2f} ms/step")
    print(f"ratio Trainer / hand   {result['ratio']:.3f}  (target <= 1.02)")
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
    return 0
