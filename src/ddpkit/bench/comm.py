"""``ddpkit bench comm``: nccl-tests for torch.distributed, on any backend.

Every operation of PyTorch's distributed tutorials (send/recv, isend/irecv, broadcast, reduce,
all_reduce, scatter, gather, all_gather), plus reduce_scatter and all_to_all, runs at each size,
once per reduce op where one applies. Each row is ``--warmup`` untimed then ``--iters`` timed
iterations; each rank takes its mean time per iteration and ``--average`` combines the ranks (the
mean, as nccl-tests does by default). After timing, one more run from fresh inputs is compared
element by element with the exact expected result (#wrong, summed over ranks). An operation the
backend refuses is reported as ``n/a`` and the run goes on.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.bench import report
from ddpkit.bench.collectives import (
    COLLECTIVES,
    REDOPS,
    Collective,
    Spec,
    all_gather_flat,
    count_wrong,
    element_count,
    unsupported,
)
from ddpkit.bench.comm_config import DEFAULT_SIZES, DTYPES, CommConfig, parse_names, parse_sizes
from ddpkit.dist import DistEnv, cpu_cores, destroy, init_distributed, resolve_backend
from ddpkit.errors import OneLineParser
from ddpkit.launch import LaunchError, launch
from ddpkit.launch.torchrun_flags import resolve_nproc

# One operation at the largest size takes well under a second; a rank still waiting after this
# long is stuck (a peer died or refused an operation), and a clear timeout beats a hang.
RUN_TIMEOUT = timedelta(minutes=5)


class CommBench:
    """Runs the rows of one benchmark on one rank; every rank runs the same rows in the same order.

    Args:
        env: this rank's distributed environment.
        cfg: what to measure.
    """

    def __init__(self, env: DistEnv, cfg: CommConfig) -> None:
        self.env, self.cfg = env, cfg
        self.dtype = DTYPES[cfg.dtype]
        self.element_size = torch.empty((), dtype=self.dtype).element_size()
        self._memcpy: dict[int, float] = {}

    def meta(self) -> dict:
        cfg, env = self.cfg, self.env
        return {
            **asdict(cfg),
            "world_size": env.world_size,
            "backend": env.backend,
            "device": env.device.type,
            "cpu_cores": cpu_cores(),
            "torch": torch.__version__,
        }

    def run(self) -> list[dict]:
        """Measure every row, printing each on rank 0 as it completes."""
        self._say(report.comm_header(self.meta()))
        records = []
        for name in self.cfg.ops:
            collective = COLLECTIVES[name]
            for redop in self.cfg.redops if collective.reduces else (None,):
                status, detail = self._status(collective, redop)
                for nbytes in self.cfg.sizes:
                    record = self._row(collective, redop, nbytes, status)
                    record["detail"] = detail
                    self._say(report.comm_row(record))
                    records.append(record)
        return records

    def _say(self, text: str) -> None:
        if self.env.is_rank0:
            print(text, flush=True)

    def _spec(self, collective: Collective, redop: str | None, count: int) -> Spec:
        env = self.env
        return Spec(env.rank, env.world_size, count, self.dtype, env.device, redop, root=0)

    def _status(self, collective: Collective, redop: str | None) -> tuple[str, str | None]:
        """(``ok`` or why the operation cannot run here, the backend's own words); the same on every rank."""
        if self.env.world_size < collective.min_ranks:
            need = collective.min_ranks
            return f"n/a (needs {need} or more processes; use --nproc {need})", None
        tiny = self._spec(collective, redop, element_count(1, 1, self.env.world_size, True))
        refused = unsupported(collective, tiny)
        flag = torch.tensor([int(refused is not None)], device=self.env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all ranks must skip the row together
        if flag.item() == 0:
            return "ok", None
        return f"n/a ({self.env.backend} does not implement it)", refused

    def _row(self, collective: Collective, redop: str | None, nbytes: int, status: str) -> dict:
        count = element_count(nbytes, self.element_size, self.env.world_size, collective.split)
        size = count * self.element_size
        record = {
            "op": collective.name,
            "redop": redop,
            "root": 0 if collective.rooted else -1,
            "size_bytes": size,
            "count": count,
            "type": report.NCCL_TYPE_NAMES[self.cfg.dtype],
            "status": status,
        }
        record.update(dict.fromkeys(("time_us", "algbw_gbps", "busbw_gbps", "wrong", "memcpy_gbps")))
        if status == "ok":
            record.update(self._measure(collective, self._spec(collective, redop, count), size))
        return record

    def _measure(self, collective: Collective, spec: Spec, size: int) -> dict:
        seconds = self._time(collective, spec)
        algbw = size / seconds / 1e9
        return {
            "time_us": seconds * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * collective.bus_factor(self.env.world_size),
            "wrong": self._wrong(collective, spec),
            "memcpy_gbps": self._memcpy_gbps(size),
        }

    def _time(self, collective: Collective, spec: Spec) -> float:
        case = collective.build(spec)
        for _ in range(self.cfg.warmup):
            case.run()
        self._sync()
        dist.barrier()  # every rank starts its timed loop together, as nccl-tests' Barrier does
        start = time.perf_counter()
        for _ in range(self.cfg.iters):
            case.run()
        self._sync()
        mine = (time.perf_counter() - start) / self.cfg.iters
        return self._combine(mine)

    def _combine(self, seconds: float) -> float:
        mine = torch.tensor([seconds], dtype=torch.float64, device=self.env.device)
        every = torch.zeros(self.env.world_size, dtype=torch.float64, device=self.env.device)
        all_gather_flat(every, mine)
        how = self.cfg.average
        value = {"mean": every.mean, "max": every.max, "min": every.min, "rank0": lambda: every[0]}[how]()
        return float(value.item())

    def _wrong(self, collective: Collective, spec: Spec) -> int:
        # Timed runs reuse their buffers (all_reduce in place grows every iteration), so the check
        # runs once more from fresh inputs.
        case = collective.build(spec)
        case.run()
        self._sync()
        wrong = torch.tensor(
            [count_wrong(case.output, case.expected)], dtype=torch.int64, device=self.env.device
        )
        dist.all_reduce(wrong)  # nccl-tests reports the sum over ranks
        return int(wrong.item())

    def _memcpy_gbps(self, nbytes: int) -> float | None:
        """Rank 0 alone copies ``nbytes`` (the others wait at the next barrier): a local reference."""
        if not self.env.is_rank0:
            return None
        if nbytes not in self._memcpy:
            src = torch.ones(nbytes, dtype=torch.uint8, device=self.env.device)
            dst = torch.empty_like(src)
            for _ in range(max(1, self.cfg.warmup)):
                dst.copy_(src)
            self._sync()
            start = time.perf_counter()
            for _ in range(self.cfg.iters):
                dst.copy_(src)
            self._sync()
            self._memcpy[nbytes] = nbytes / ((time.perf_counter() - start) / self.cfg.iters) / 1e9
        return self._memcpy[nbytes]

    def _sync(self) -> None:
        # CUDA collectives return before the GPU finishes; gloo on CPU is already synchronous.
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)


def _worker(cfg: CommConfig) -> tuple[dict, list[dict]] | None:
    env = init_distributed(cfg.backend, timeout=RUN_TIMEOUT)
    try:
        bench = CommBench(env, cfg)
        records = bench.run()
        return (bench.meta(), records) if env.is_rank0 else None
    finally:
        destroy()


def run_comm(cfg: CommConfig, nproc: int) -> tuple[dict, list[dict]]:
    """Run the benchmark on ``nproc`` new local processes; returns rank 0's meta and records.

    Args:
        cfg: what to measure.
        nproc: number of processes.
    """
    return launch(_worker, nproc, (cfg,))[0]


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="ddpkit bench comm",
        description="nccl-tests for torch.distributed: time, bandwidth and an exact check of every result.",
    )
    p.add_argument(
        "--nproc", metavar="N", default="auto", help="processes: a number, or auto (GPUs, else CPU cores)"
    )
    p.add_argument(
        "--ops", metavar="OP,...", default="all", help=f"comma-separated, or all: {', '.join(COLLECTIVES)}"
    )
    p.add_argument(
        "--redops", metavar="OP,...", default="all", help="comma-separated, or all: sum, prod, max, min"
    )
    p.add_argument(
        "--sizes", metavar="MIN:MAX[:F]", default=DEFAULT_SIZES, help="bytes, K, M or G (nccl-tests -b/-e/-f)"
    )
    p.add_argument("--dtype", default="float32", help=f"element type: {', '.join(DTYPES)}")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per row (nccl-tests -n)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations before them (nccl-tests -w)")
    p.add_argument(
        "--average", default="mean", help="combine ranks' times: mean, max, min, rank0 (nccl-tests -a)"
    )
    p.add_argument("--backend", default="auto", help="auto, gloo, nccl or mpi")
    p.add_argument(
        "--json", metavar="FILE", type=Path, help="write one record per op, redop and size to this file"
    )
    p.add_argument(
        "--plot", metavar="FILE", type=Path, help="write a PNG of bus bandwidth against size to this file"
    )
    return p


def config_from_args(ns: argparse.Namespace) -> CommConfig:
    return CommConfig(
        ops=parse_names(ns.ops, tuple(COLLECTIVES), "--ops"),
        redops=parse_names(ns.redops.replace("product", "prod"), tuple(REDOPS), "--redops"),
        sizes=parse_sizes(ns.sizes),
        dtype=ns.dtype,
        iters=ns.iters,
        warmup=ns.warmup,
        average=ns.average,
        backend=ns.backend,
    )


def main(argv: list[str]) -> int:
    """``ddpkit bench comm``: 0 when every result was right, 1 when any was wrong or a rank failed."""
    ns = parser().parse_args(argv)
    cfg = config_from_args(ns)
    nproc = resolve_nproc(ns.nproc)
    resolve_backend(cfg.backend, nproc)  # a backend that cannot work here fails before any process starts
    if nproc > cpu_cores():
        print(f"# note: {nproc} processes share {cpu_cores()} cores; times include waiting for a core")
    try:
        meta, records = run_comm(cfg, nproc)
    except LaunchError as exc:
        print(f"ddpkit: bench comm: {exc}", file=sys.stderr)
        return 1
    print(report.comm_summary(records))
    if ns.json:
        report.write_json(ns.json, meta, records)
    if ns.plot:
        title = f"{meta['backend']}, {meta['world_size']} processes, {meta['dtype']}"
        report.plot_comm(records, ns.plot, title)
    return 0 if all(r["wrong"] in (0, None) for r in records) else 1
