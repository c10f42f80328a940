"""``ddpkit bench setup-memory``: what a rank holds while ``run.setup`` builds a sharded model.

The point of ``engine="fsdp"`` is a model that does not fit one device; ``run.setup`` must then
never hold it whole. For each process count (``--nproc 1,2,3``) and each way to build (``eager``:
``Net()`` on every rank, then ``run.setup``; ``meta``: ``ddpkit.empty_init()`` and
``run.setup(net, weights=FILE)`` from a ``torch.save`` of the same weights), one launch reports
per rank:

- ``setup``: the peak of the process's anonymous resident memory (``RssAnon``: what it allocated
  itself, not the pages of the mapped weights file, which the kernel shares and may drop) over
  its level once the process group was joined, before the model was built, sampled every
  millisecond by a thread;
- ``steady``: the same peak over 3 AdamW steps after setup (parameters, gradients, optimizer
  state and activations);
- ``held``: the parameter bytes the rank keeps (its shards);
- ``file`` (meta): the most of the weights file resident in the rank's mappings during setup
  (its ``Rss`` in /proc/self/smaps): the part of the file it touched, its shards' rows.

Each is also given as a fraction of the full model's fp32 bytes. A rank of the meta build on
N processes should hold about 1/N of the model, plus one group gathered at a time.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.bench.fsdp_bench import local_bytes
from ddpkit.errors import OneLineParser
from ddpkit.launch import launch


class Net(nn.Module):
    """``layers`` residual layers of ``width`` x ``width``: each layer is a group of its own."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def anon_mb() -> float:
    """This process's anonymous resident memory, MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def mapped_mb(path: str) -> float:
    """This process's resident pages of its mappings of the file ``path``, MiB (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                inside = line.rstrip("\n").endswith(" " + path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total / 1024


class PeakSampler:
    """The highest ``anon_mb`` seen since ``reset``, sampled by a thread every millisecond, and
    (``watch``: a file's path) the most of that file resident in the process's mappings
    (``file_peak``, sampled every 5 ms: reading smaps takes milliseconds)."""

    def __init__(self, watch: str | None = None) -> None:
        self.peak, self.file_peak, self.watch, self._stop = anon_mb(), 0.0, watch, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, anon_mb())
            tick += 1
            if self.watch is not None and tick % 5 == 0:
                self.file_peak = max(self.file_peak, mapped_mb(self.watch))

    def reset(self) -> float:
        self.peak, self.file_peak = anon_mb(), 0.0
        return self.peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _rank(build: str, layers: int, width: int, weights: str) -> dict:
    import torch.distributed.fsdp  # noqa: F401  (its imports are not the model's memory)

    sampler = PeakSampler(watch=weights if build == "meta" else None)
    run = ddpkit.Run(engine="fsdp", global_batch=8, progress=False, backend="gloo")
    base = sampler.reset()  # after the process group and the imports
    try:
        if build == "meta":
            with ddpkit.empty_init():
                net = Net(layers, width)
            model = run.setup(net, weights=weights)
        else:
            torch.manual_seed(0)
            model = run.setup(Net(layers, width))
        setup, file_setup = sampler.peak - base, sampler.file_peak
        held = local_bytes(model.parameters()) / 2**20
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        run.track(optimizer)
        before = sampler.reset()
        for _ in range(3):
            x = torch.randn(8 // run.world_size, width)
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), x))
            optimizer.step()
        steady = sampler.peak - before
        return {"setup_mb": setup, "steady_mb": steady, "held_mb": held, "file_mb": file_setup}
    finally:
        sampler.stop()
        run.close()


def measure(nprocs: list[int], builds: list[str], layers: int, width: int) -> list[dict]:
    """One launch per (process count, build); the rows with every rank's figures."""
    model_mb = layers * (width * width + width) * 4 / 2**20
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-setup-memory-") as folder:
        weights = str(Path(folder) / "weights.pt")
        torch.manual_seed(0)
        torch.save(Net(layers, width).state_dict(), weights)
        for nproc in nprocs:
            for build in builds:
                ranks = launch(_rank, nproc, (build, layers, width, weights))
                rows.append({"nproc": nproc, "build": build, "model_mb": model_mb, "ranks": ranks})
    return rows


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="ddpkit bench setup-memory", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", default="1,2,3", help="process counts, comma-separated")
    parser.add_argument("--builds", default="eager,meta", help="eager, meta or both")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048, help="24 x 2048: 100.7M parameters, 384 MiB")
    parser.add_argument("--json", help="write the rows here")
    ns = parser.parse_args(argv)
    started = time.perf_counter()
    nprocs, builds = [int(n) for n in ns.nproc.split(",")], ns.builds.split(",")
    rows = measure(nprocs, builds, ns.layers, ns.width)
    model_mb = rows[0]["model_mb"]
    shape = f"{ns.layers} x {ns.width} layers, {model_mb:.0f} MiB of fp32 weights"
    print(f"# ddpkit bench setup-memory: fsdp, {shape}")
    print("# per rank, the largest over ranks: MiB (fraction of the model)")
    print(f"{'nproc':>5} {'build':>6} {'setup peak':>18} {'steady peak':>18} {'held':>18} {'file':>18}")
    for row in rows:
        cells = []
        for key in ("setup_mb", "steady_mb", "held_mb", "file_mb"):
            most = max(rank[key] for rank in row["ranks"])
            cells.append(f"{most:9.0f} ({most / model_mb:.2f}x)")
        print(f"{row['nproc']:>5} {row['build']:>6} " + " ".join(f"{c:>18}" for c in cells))
    print(f"# {time.perf_counter() - started:.0f} s")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0
