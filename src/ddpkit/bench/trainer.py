"""`ddpkit bench trainer`: what ddpkit.Run and the Trainer cost over a hand-written DDP loop, in one run.

The loops (``bench/loops.py``) train their own copy of the same model on the same data with the
same AdamW, schedule and gradient clipping, alternating in blocks of steps so that machine noise
hits them alike. The hand-written loop is the seeds' loop: DataLoader + DistributedSampler,
loss.backward(), step(). ``--slow-data-ms`` makes every sample cost that much CPU (an image
decode), and ``--num-workers`` loads in DataLoader workers, for both loops.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

import ddpkit
from ddpkit.bench.loops import HandLoop, RunLoop, SlowData
from ddpkit.errors import OneLineParser
from ddpkit.train import TrainConfig, Trainer
from ddpkit.train.callbacks import Callback
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


def _rank(ns_dict: dict, out: str) -> dict:
    ns = _Args(**ns_dict)
    env = ddpkit.init_distributed("gloo")
    # AdamW's second moments on small models decay into denormal floats, whose arithmetic is
    # ~100x slower on x86 CPUs and drifts over the run; flushing them (for every loop alike)
    # keeps that from drowning the loop overhead this bench measures.
    torch.set_flush_denormal(True)
    try:
        torch.manual_seed(0)
        steps = ns.blocks * ns.block
        cfg = with_defaults(
            TrainConfig(
                workload=ns.workload, global_batch=ns.global_batch, out=out, steps=steps, log_every=10**9
            )
        )
        job = get_workload(ns.workload).build(cfg)
        dataset = SlowData(job.dataset, ns.slow_data_ms) if ns.slow_data_ms else job.dataset
        loops = {"hand": HandLoop(job, dataset, cfg, env, ns.num_workers)}
        loops["run"] = RunLoop(job, dataset, cfg, f"{out}/run", ns.num_workers)
        if ns.num_workers == 0:  # the Trainer fetches samples in the training process only
            loops["trainer"] = TrainerLoop(job, dataset, cfg, env)
        for _ in range(ns.blocks):
            for loop in loops.values():
                loop.run(ns.block)
        loops["run"].close()
        return {name: loop.times[ns.block :] for name, loop in loops.items()}  # first block: warm-up
    finally:
        ddpkit.destroy()


class _Args:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


class TrainerLoop:
    """The built-in Trainer, run a block of steps at a time, with no progress bar or metrics file."""

    def __init__(self, job, dataset, cfg, env) -> None:
        self.clock = StepClock()
        self.trainer = Trainer(job.model, dataset, job.loss_fn, env, cfg, callbacks=[self.clock])
        self.trainer.callbacks = [self.clock]

    @property
    def times(self) -> list[float]:
        return self.clock.times

    def run(self, steps: int) -> None:
        self.trainer.total_steps = self.trainer.step + steps
        self.trainer.fit()


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="ddpkit bench trainer", description=__doc__.split("\n")[0])
    parser.add_argument("workload", nargs="?", default="gpt")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=8, help="alternations (the first is warm-up)")
    parser.add_argument("--block", type=int, default=10, help="steps per block")
    parser.add_argument("--slow-data-ms", type=float, default=0.0, help="CPU milliseconds per sample")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    with TemporaryDirectory(prefix="ddpkit-bench-") as out:
        ranks = ddpkit.launch(_rank, ns.nproc, (vars(ns), out))
    # A step takes as long as its slowest rank.
    steps = {name: [max(t) for t in zip(*(r[name] for r in ranks), strict=True)] for name in ranks[0]}
    median = {name: statistics.median(times) for name, times in steps.items()}
    result = {
        **{k: v for k, v in vars(ns).items() if k != "json"},
        "steps": len(steps["hand"]),
        **{f"{name}_median_ms": 1e3 * m for name, m in median.items()},
        **{f"{name}_ratio": median[name] / median["hand"] for name in median if name != "hand"},
    }
    print(
        f"# ddpkit bench trainer: {ns.workload}, {ns.nproc} processes, global batch {ns.global_batch}, "
        f"{ns.num_workers} DataLoader workers, {ns.slow_data_ms:g} ms of CPU per sample; "
        f"{len(steps['hand'])} timed steps each, alternating blocks of {ns.block}"
    )
    names = {"hand": "hand-written DDP loop", "run": "ddpkit.Run loop", "trainer": "ddpkit Trainer"}
    for name, m in median.items():
        ratio = "" if name == "hand" else f"   / hand {m / median['hand']:.3f}  (target <= 1.02)"
        print(f"{names[name]:<22} median {1e3 * m:8.2f} ms/step{ratio}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
    return 0
