"""``ddpkit bench scaling``: training throughput and scaling efficiency at each process count.

Each process count trains the workload with ddpkit's own ``Trainer`` (DistributedDataParallel)
on processes started by ``ddpkit.launch``, for ``--steps`` steps; the first ``--warmup`` steps
are not timed (process-group connections, allocator growth, DDP's first-iteration bucket
rebuild). Throughput is samples per second over the remaining steps, measured on rank 0.

Strong scaling (the default) keeps the global batch fixed: each of n processes takes
global_batch / n samples, and ideally a step takes 1/n of the time. Weak scaling (``--scaling
weak``) keeps each process's batch fixed, so the global batch grows with n and ideally a step
takes as long as with one process. Either way ``efficiency = speedup / (n / base)``, where
speedup is throughput relative to the smallest process count, ``base``.

With two or more GPUs visible, ``nn.DataParallel`` (one process driving n GPUs from threads)
runs beside DDP at every count that fits, the comparison PyTorch's DDP tutorials discuss; its
``nproc`` is GPUs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ddpkit.bench import costmodel, report
from ddpkit.bench.dataparallel import dataparallel_throughput
from ddpkit.dist import cpu_cores, destroy, init_distributed, resolve_backend
from ddpkit.errors import ConfigError, OneLineParser
from ddpkit.launch import LaunchError, launch
from ddpkit.launch.torchrun_flags import resolve_nproc
from ddpkit.run import Run
from ddpkit.run.config import check_split
from ddpkit.train.job import JobConfig, layered
from ddpkit.train.trainer import Trainer
from ddpkit.train.workloads import WORKLOADS, get_workload

SCALINGS = ("strong", "weak")


@dataclass(frozen=True)
class ScalingConfig:
    """What ``ddpkit bench scaling`` runs.

    Args:
        workload: built-in workload: toy, convnet or gpt.
        nprocs: process counts to run, ascending; the first is the baseline for speedup.
        steps: optimizer steps per run, warm-up included.
        warmup: leading steps excluded from the timing.
        global_batch: the global batch at the first process count; the workload's default if None.
        scaling: ``strong`` (global batch fixed) or ``weak`` (per-process batch fixed).
        backend: process-group backend: auto, gloo, nccl or mpi.
        seed: seeds model init and data order.
        dataparallel: also run nn.DataParallel where two or more GPUs are visible.
        threads: CPU threads per process, the same at every count so that each added process
            adds the same compute, as an added GPU would; None: cores / the largest count.
    """

    workload: str = "toy"
    nprocs: tuple[int, ...] = (1, 2)
    steps: int = 50
    warmup: int = 10
    global_batch: int | None = None
    scaling: str = "strong"
    backend: str = "auto"
    seed: int = 0
    dataparallel: bool = True
    threads: int | None = None

    def __post_init__(self) -> None:
        get_workload(self.workload)
        if not self.nprocs or list(self.nprocs) != sorted(set(self.nprocs)) or self.nprocs[0] < 1:
            raise ConfigError(
                f"--nproc {self.nprocs}: give distinct positive counts in ascending order, e.g. 1,2,4"
            )
        if not 0 <= self.warmup < self.steps:
            raise ConfigError(
                f"--warmup {self.warmup} must be at least 0 and below --steps {self.steps}; "
                "for example --steps 50 --warmup 10"
            )
        if self.scaling not in SCALINGS:
            raise ConfigError(f"--scaling {self.scaling!r} is unknown; choose strong or weak")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads {self.threads} is below 1; use a positive number or leave it out")
        check_split(self.base_batch, self.nprocs[0])
        for n in self.nprocs:
            check_split(self.batch_at(n), n)

    @property
    def threads_per_process(self) -> int:
        """CPU threads each process uses."""
        return self.threads or max(1, cpu_cores() // self.nprocs[-1])

    @property
    def base_batch(self) -> int:
        """The global batch at the first process count."""
        return self.global_batch or WORKLOADS[self.workload].defaults["global_batch"]

    def batch_at(self, nproc: int) -> int:
        """The global batch with ``nproc`` processes."""
        if self.scaling == "strong":
            return self.base_batch
        return self.base_batch // self.nprocs[0] * nproc

    def train_config(self, nproc: int, out: str) -> JobConfig:
        """One run's config: it logs only after the last step, outside the timing, and saves nothing."""
        changes = {"steps": self.steps, "global_batch": self.batch_at(nproc), "seed": self.seed, "out": out}
        changes |= {"log_every": self.steps, "backend": self.backend, "save_every": 0, "progress": False}
        return layered(self.workload, WORKLOADS[self.workload].defaults, changes)


class TimedTrainer(Trainer):
    """The built-in Trainer, timing its steps after warm-up: from the end of step ``warmup`` to
    the end of the last step (set ``warmup`` before ``fit``)."""

    warmup = 0

    def _run_batch(self, batch) -> None:
        super()._run_batch(batch)
        step = self.run.step
        if self.run.at_step_end and step in (1, self.warmup, self.total_steps):
            if self.run.device.type == "cuda":
                torch.cuda.synchronize(self.run.device)  # kernels still queued belong to the step
            if step in (1, self.warmup):
                self.start = time.perf_counter()
            if step == self.total_steps:
                self.end, self.steps = time.perf_counter(), step - max(1, self.warmup)

    def throughput(self, global_batch: int) -> tuple[float, float]:
        """(samples per second, seconds per step) over the timed steps."""
        seconds = (self.end - self.start) / self.steps
        return global_batch / seconds, seconds


def _ddp_worker(cfg: ScalingConfig, nproc: int, out: str) -> tuple[float, float] | None:
    env = init_distributed(cfg.backend)
    # init_distributed shares the cores among this run's processes, which would give one process
    # every core and n processes 1/n each: not a fair scaling comparison (and with a busy machine,
    # idle OpenMP threads waiting on each other slow tiny models down 100-fold).
    torch.set_num_threads(cfg.threads_per_process)
    try:
        job = cfg.train_config(nproc, out)
        run = Run(**job.run_options())
        trainer = TimedTrainer(run, get_workload(cfg.workload).build(job), job.train)
        trainer.warmup = cfg.warmup
        trainer.fit()
        return trainer.throughput(job.data.global_batch) if env.is_rank0 else None
    finally:
        destroy()


def _record(cfg: ScalingConfig, engine: str, nproc: int, measured: tuple[float, float]) -> dict:
    batch = cfg.batch_at(nproc)
    return {
        "engine": engine,
        "nproc": nproc,
        "global_batch": batch,
        "batch_per_process": batch // nproc,
        "samples_per_s": measured[0],
        "step_ms": measured[1] * 1e3,
    }


def add_efficiency(records: list[dict]) -> list[dict]:
    """Fill speedup and efficiency of each record against the first record of the same engine."""
    base: dict[str, dict] = {}
    for r in records:
        first = base.setdefault(r["engine"], r)
        r["speedup"] = r["samples_per_s"] / first["samples_per_s"]
        r["efficiency"] = r["speedup"] / (r["nproc"] / first["nproc"])
    return records


def run_scaling(cfg: ScalingConfig) -> list[dict]:
    """Run DDP at every process count (and DataParallel where GPUs allow); records with efficiency."""
    records = []
    gpus = torch.cuda.device_count() if cfg.dataparallel else 0
    with tempfile.TemporaryDirectory(prefix="ddpkit-scaling-") as out:
        for n in cfg.nprocs:
            print(f"# ddp: {n} process(es), global batch {cfg.batch_at(n)}", flush=True)
            measured = launch(_ddp_worker, n, (cfg, n, str(Path(out) / f"ddp{n}")))[0]
            records.append(_record(cfg, "ddp", n, measured))
        for n in (n for n in cfg.nprocs if 2 <= gpus and n <= gpus):
            print(f"# dataparallel: {n} GPU(s) in one process", flush=True)
            measured = dataparallel_throughput(cfg.train_config(n, out), n, cfg.warmup)
            records.append(_record(cfg, "dataparallel", n, measured))
    return add_efficiency(records)


def _default_nprocs() -> str:
    most, counts = resolve_nproc("auto"), [1]
    while counts[-1] * 2 <= most:
        counts.append(counts[-1] * 2)
    return ",".join(map(str, counts))


def parse_nprocs(text: str) -> tuple[int, ...]:
    """``1,2,4`` -> (1, 2, 4); each entry may also be ``auto``."""
    try:
        return tuple(resolve_nproc(part.strip()) for part in text.split(","))
    except ConfigError:
        raise ConfigError(
            f"--nproc {text!r} is not a list of process counts; use e.g. --nproc 1,2,4"
        ) from None


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="ddpkit bench scaling",
        description="Training throughput and scaling efficiency at each process count.",
    )
    p.add_argument("--predict", action="store_true", help="the cost model instead: see --predict --help")
    p.add_argument("workload", nargs="?", default="toy", help=f"one of {', '.join(WORKLOADS)}")
    p.add_argument("--nproc", metavar="N,N,...", help="process counts (default: 1, 2, 4 ... up to auto)")
    p.add_argument("--steps", type=int, default=50, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=10, help="leading steps left out of the timing")
    p.add_argument("--global-batch", type=int, help="global batch at the first count (workload default)")
    p.add_argument("--scaling", default="strong", help="strong: fixed global batch; weak: fixed per process")
    p.add_argument("--backend", default="auto", help="auto, gloo, nccl or mpi")
    p.add_argument("--seed", type=int, default=0, help="seed for model init and data order")
    p.add_argument("--threads", type=int, help="CPU threads per process (default: cores / largest count)")
    p.add_argument("--no-dataparallel", action="store_true", help="skip nn.DataParallel even with 2+ GPUs")
    p.add_argument("--json", metavar="FILE", type=Path, help="write one record per engine and count")
    p.add_argument("--plot", metavar="FILE", type=Path, help="write a PNG of throughput and efficiency")
    return p


def config_from_args(ns: argparse.Namespace) -> ScalingConfig:
    return ScalingConfig(
        workload=ns.workload,
        nprocs=parse_nprocs(ns.nproc or _default_nprocs()),
        steps=ns.steps,
        warmup=ns.warmup,
        global_batch=ns.global_batch,
        scaling=ns.scaling,
        backend=ns.backend,
        seed=ns.seed,
        dataparallel=not ns.no_dataparallel,
        threads=ns.threads,
    )


def main(argv: list[str]) -> int:
    """``ddpkit bench scaling``: 0 on success, 1 when a run failed; ``--predict``: the cost model."""
    if "--predict" in argv:
        return costmodel.main(argv)
    ns = parser().parse_args(argv)
    cfg = config_from_args(ns)
    for n in cfg.nprocs:
        resolve_backend(cfg.backend, n)  # nccl with more processes than GPUs fails here, not in a worker
    if cfg.nprocs[-1] > cpu_cores() and not torch.cuda.is_available():
        print(f"# note: up to {cfg.nprocs[-1]} processes share {cpu_cores()} cores; expect low efficiency")
    try:
        records = run_scaling(cfg)
    except LaunchError as exc:
        print(f"ddpkit: bench scaling: {exc}", file=sys.stderr)
        return 1
    meta = scaling_meta(cfg)
    print(report.scaling_table(records, meta))
    if ns.json:
        report.write_json(ns.json, meta, records)
    if ns.plot:
        title = f"{cfg.workload}, {cfg.scaling} scaling, {meta['backend']}"
        report.plot_scaling(records, ns.plot, title)
    return 0


def scaling_meta(cfg: ScalingConfig) -> dict:
    """The run's settings for the table header and the JSON file."""
    return {
        **asdict(cfg),
        "backend": resolve_backend(cfg.backend, cfg.nprocs[-1]),
        "base_nproc": cfg.nprocs[0],
        "global_batch": cfg.base_batch,
        "batch_per_process": cfg.base_batch // cfg.nprocs[0],
        "cpu_cores": cpu_cores(),
        "threads_per_process": cfg.threads_per_process,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
    }
