"""`ddpkit bench trainer`: what ddpkit.Run and the Trainer cost over a hand-written DDP loop, in one run.

The loops (``bench/loops.py``) train their own copy of the same model on the same data with the
same AdamW, schedule and gradient clipping, alternating in blocks of steps so that machine noise
hits them alike. The hand-written loop is the DDP tutorials' loop: DataLoader + DistributedSampler,
loss.backward(), step(). ``--slow-data-ms`` makes every sample cost that much CPU (an image
decode), and ``--num-workers`` loads in DataLoader workers, for both loops, each with its
DataLoader's defaults (Run's are torch's: no persistent workers, a prefetch factor of 2).

Each ratio to the hand-written loop is the median over rounds (one block of each loop) of that
round's ratio, so load that drifts between rounds cancels; the 90% interval says how far that
median could move were the rounds run again. "step" compares the rounds' median steps (what
the step target is on); "time" their whole blocks, log and check steps included (throughput);
"cpu" the CPU time of the training thread over whole blocks (DataLoader workers not counted),
which says what a loop itself costs even on a machine whose load swings its wall times.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
from torch.utils.flop_counter import FlopCounterMode

import ddpkit
from ddpkit.bench.engine_summary import interval90
from ddpkit.bench.loops import HandLoop, RunLoop, SlowData
from ddpkit.data.text import CharDataset
from ddpkit.errors import ConfigError, OneLineParser
from ddpkit.models.gpt import GPT, GPTConfig
from ddpkit.run import Run
from ddpkit.run.monitor.log_gather import device_peak, peak_memory_mb
from ddpkit.train import Task, Trainer
from ddpkit.train.job import layered
from ddpkit.train.workloads import WORKLOADS, get_workload


def _rank(ns_dict: dict, out: str) -> dict:
    ns = _Args(**ns_dict)
    env = ddpkit.init_distributed("nccl" if ns.device == "cuda" else "gloo")
    # AdamW's second moments on small models decay into denormal floats, whose arithmetic is
    # ~100x slower on x86 CPUs and drifts over the run; flushing them (for every loop alike)
    # keeps that from drowning the loop overhead this bench measures.
    torch.set_flush_denormal(True)
    try:
        torch.manual_seed(0)
        steps = ns.blocks * ns.block
        given = {"global_batch": ns.global_batch, "out": out, "steps": steps, "progress": False}
        given |= {"save_every": 0, "precision": ns.precision}
        job_cfg = layered(ns.workload, WORKLOADS[ns.workload].defaults, given)
        # The loops read the flat fields (lr, grad_clip, ...).
        cfg = _Args(**job_cfg.values(), compile=ns.compile)
        job = sized(get_workload(ns.workload).build(job_cfg), ns.gpt)
        dataset = SlowData(job.dataset, ns.slow_data_ms) if ns.slow_data_ms else job.dataset
        loops = {"hand": HandLoop(job, dataset, cfg, env, ns.num_workers)}
        loops["run"] = RunLoop(job, dataset, cfg, f"{out}/run", ns.num_workers)
        loops["trainer"] = TrainerLoop(job, dataset, job_cfg, ns.num_workers)
        cpu: dict[str, list[float]] = {name: [] for name in loops}
        peak: dict[str, float] = dict.fromkeys(loops, 0.0)
        for round_ in range(ns.blocks):
            # ABBA order: whichever loop goes first in a round also meets what the one before it
            # left running (its DataLoader workers refilling), so the order flips every round.
            order = list(loops.items()) if round_ % 2 == 0 else list(loops.items())[::-1]
            for name, loop in order:
                if env.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(env.device)
                start = time.thread_time()
                loop.run(ns.block)
                cpu[name].append(time.thread_time() - start)
                peak[name] = max(peak[name], peak_memory_mb(env.device)[1])
        loops["run"].close()
        loops["trainer"].close()
        # First block: warm-up.
        times = {name: loop.times[ns.block :] for name, loop in loops.items()}
        return {"times": times, "cpu": cpu, "peak_cuda_mb": peak, "per_sample": per_sample(job, env.device)}
    finally:
        ddpkit.destroy()


def sized(job: Task, gpt: str) -> Task:
    """The workload's task, or with ``gpt="small"`` its GPT at GPT-2 small's shape (12 layers of
    768, 12 heads, 1024 tokens of context; 85M parameters besides the embeddings)."""
    if gpt == "default":
        return job
    shape = GPTConfig(
        vocab_size=job.model.config.vocab_size, block_size=1024, n_layer=12, n_head=12, n_embd=768
    )
    return Task(GPT(shape), CharDataset(job.dataset.data, shape.block_size), job.loss_fn)


def per_sample(job: Task, device: torch.device) -> dict:
    """One sample's tokens (its input's length when that is token ids) and FLOPs (forward and
    backward, counted once by torch's FlopCounterMode on a copy of the model)."""
    x, y = (t.unsqueeze(0).to(device) for t in job.dataset[0])
    model = copy.deepcopy(job.model).to(device)
    with FlopCounterMode(display=False) as counter:
        job.loss_fn(model(x), y).backward()
    tokens = x.shape[1] if not x.is_floating_point() and x.dim() == 2 else 0
    return {"tokens": tokens, "flops": counter.get_total_flops()}


class _Args:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


class TrainerLoop:
    """The built-in Trainer (its own Run, with the Run's defaults), run a block of steps at a time."""

    def __init__(self, job: Task, dataset, cfg, num_workers: int) -> None:
        cfg = cfg.replace(out=f"{cfg.run.out}/trainer", num_workers=num_workers)
        task = Task(copy.deepcopy(job.model), dataset, job.loss_fn)
        self.trainer = Trainer(Run(**cfg.run_options()), task, cfg.train)
        self.batches = iter(self.trainer.loader)
        self.times: list[float] = []

    def run(self, steps: int) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            try:
                batch = next(self.batches)
            except StopIteration:  # the loader moves to the next epoch by itself
                self.batches = iter(self.trainer.loader)
                batch = next(self.batches)
            self.trainer.fit_batch(batch)
            self.times.append(time.perf_counter() - start)

    def close(self) -> None:
        self.trainer.run.finish()


def _rounds(ranks: list[dict], name: str, block: int) -> list[list[float]]:
    """Per round, each step's time on the slowest rank: a step takes as long as its slowest rank."""
    steps = [max(t) for t in zip(*(r["times"][name] for r in ranks), strict=True)]
    return [steps[i : i + block] for i in range(0, len(steps), block)]


def _cpu_rounds(ranks: list[dict], name: str) -> list[float]:
    """Per timed round, the training thread's CPU seconds summed over ranks (workers not counted)."""
    return [sum(block) for block in zip(*(r["cpu"][name][1:] for r in ranks), strict=True)]


def summarize(ranks: list[dict], block: int) -> dict:
    """Per loop: median step, and per-round ratios to the hand-written loop with 90% intervals.

    ``cpu`` compares the training thread's CPU time: what a loop itself adds, which load from
    other processes on the machine moves far less than it moves wall time.
    """
    rounds = {name: _rounds(ranks, name, block) for name in ranks[0]["times"]}
    cpu = {name: _cpu_rounds(ranks, name) for name in rounds}
    rows = {}
    for name, blocks in rounds.items():
        row = {"median_ms": 1e3 * statistics.median(t for b in blocks for t in b)}
        row["cpu_ms_per_step"] = 1e3 * sum(cpu[name]) / len(ranks) / sum(map(len, blocks))
        if name != "hand":
            for kind, of in (("step", statistics.median), ("time", sum)):
                ratios = [of(a) / of(h) for a, h in zip(blocks, rounds["hand"], strict=True)]
                row[f"{kind}_ratio"] = statistics.median(ratios)
                row[f"{kind}_interval90"] = interval90(ratios)
            # What the loop adds to a step, in microseconds: per round, median minus median.
            pairs = zip(blocks, rounds["hand"], strict=True)
            added = [1e6 * (statistics.median(a) - statistics.median(h)) for a, h in pairs]
            row["added_us"], row["added_us_interval90"] = statistics.median(added), interval90(added)
            ratios = [a / h for a, h in zip(cpu[name], cpu["hand"], strict=True)]
            row["cpu_ratio"], row["cpu_interval90"] = statistics.median(ratios), interval90(ratios)
        rows[name] = row
    return rows


def speeds(rows: dict, ranks: list[dict], ns) -> None:
    """Tokens a second, MFU and peak device memory per loop, from its median step (on a GPU the
    whole blocks' time, which waits for the device, gives the same per step within noise)."""
    sample = ranks[0]["per_sample"]
    peak = device_peak(torch.device(ns.device), ns.peak_flops)
    for name, row in rows.items():
        per_s = ns.global_batch / (row["median_ms"] / 1e3)
        if sample["tokens"]:
            row["tokens_per_s"] = per_s * sample["tokens"]
        if peak:
            row["mfu"] = per_s * sample["flops"] / (peak * ns.nproc)
        row["peak_cuda_mb"] = max(r["peak_cuda_mb"][name] for r in ranks)


def _targets(ns) -> str:
    if ns.num_workers:  # with slow data the target is throughput, i.e. time per step
        return f"time <= {1 / 0.95:.3f} (throughput >= 0.95)"
    if ns.nproc == 1 and ns.device == "cpu":  # a world of one on a CPU: the toy MLP's cost in us
        return "at most +50 us a step over the plain loop (toy); step <= 1.02 on a GPU"
    return "step <= 1.02"


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="ddpkit bench trainer", description=__doc__.split("\n")[0])
    parser.add_argument("workload", nargs="?", default="gpt")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=21, help="alternations (the first is warm-up)")
    parser.add_argument("--block", type=int, default=10, help="steps per block")
    parser.add_argument("--slow-data-ms", type=float, default=0.0, help="CPU milliseconds per sample")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile every loop's model")
    parser.add_argument(
        "--gpt", choices=("default", "small"), default="default", help="small: GPT-2 small's shape"
    )
    parser.add_argument(
        "--peak-flops", type=float, help="one device's peak FLOP/s for MFU (default: a GPU's)"
    )
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    if ns.gpt != "default" and ns.workload != "gpt":
        raise ConfigError(f"--gpt {ns.gpt} sizes the gpt workload's model; drop it for {ns.workload}")
    if ns.device == "cuda" and torch.cuda.device_count() < ns.nproc:
        raise ConfigError(
            f"--device cuda --nproc {ns.nproc} needs {ns.nproc} GPUs; this machine has "
            f"{torch.cuda.device_count()}: pass --nproc {torch.cuda.device_count()} or --device cpu"
        )
    with TemporaryDirectory(prefix="ddpkit-bench-") as out:
        ranks = ddpkit.launch(_rank, ns.nproc, (vars(ns), out))
    rows = summarize(ranks, ns.block)
    speeds(rows, ranks, ns)
    timed = len(ranks[0]["times"]["hand"])
    print(
        f"# ddpkit bench trainer: {ns.workload}, {ns.nproc} processes on {ns.device}, {ns.precision}"
        f"{', compiled' if ns.compile else ''}, global batch {ns.global_batch}, "
        f"{ns.num_workers} DataLoader workers, {ns.slow_data_ms:g} ms of CPU per sample; "
        f"{timed} timed steps each, alternating blocks of {ns.block}; ratios: median [90% interval]"
    )
    hand = "hand-written DDP loop" if ranks and len(ranks) > 1 else "plain loop (no DDP)"
    names = {"hand": hand, "run": "ddpkit.Run loop", "trainer": "ddpkit Trainer"}
    for name, row in rows.items():
        line = f"{names[name]:<22} median {row['median_ms']:8.2f} ms/step"
        line += f", CPU {row['cpu_ms_per_step']:7.2f} ms"
        line += f", {row['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in row else ""
        line += f", MFU {row['mfu']:.1%}" if "mfu" in row else ""
        line += f", peak {row['peak_cuda_mb']:.0f} MiB" if row.get("peak_cuda_mb") else ""
        if name != "hand":
            low, high = row["added_us_interval90"]
            line += f"   {row['added_us']:+.0f} us/step [{low:+.0f}, {high:+.0f}]"
            for kind in ("step", "time", "cpu"):
                low, high = row[f"{kind}_interval90"]
                line += f"   {kind} / hand {row[f'{kind}_ratio']:.3f} [{low:.3f}, {high:.3f}]"
        print(line)
    print(f"target: {_targets(ns)}")
    if ns.json:
        result = {k: v for k, v in vars(ns).items() if k != "json"} | {"steps": timed, "loops": rows}
        Path(ns.json).write_text(json.dumps(result, indent=2))
    return 0
