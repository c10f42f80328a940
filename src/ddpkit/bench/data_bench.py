"""`ddpkit bench data`: what run.loader's per-sample seeding costs over a plain DataLoader, in one run.

A single-device script's dataset draws its augmentation from some generator; run.loader seeds
every generator the dataset draws from before each sample (``run/invariant/seeding.py``), so that a
sample draws the same on any number of processes and after a resume. This benchmark prices that
in a world of one, on three datasets of 32x32 images:

- ``tensor``: a TensorDataset, the cheapest there is; torch's own, it cannot draw, and is
  fetched plainly;
- ``fixed``: the same samples from a class of the user's, which draws nothing but might: it is
  watched every batch;
- ``crop``: a random 32x32 crop of a 40x40 image and a random flip, drawn from the dataset's
  own ``np.random.default_rng()`` (20-50 us of work a sample, the case the target is set for);
- ``globals``: the same crop drawn from python's, numpy's and torch's global generators;
- ``sample_rng``: the crop ported to ``ddpkit.sample_rng()`` (``draws_random = "sample_rng"``),
  against the plain loader on ``crop``, the dataset it was ported from.

Each is loaded by torch's DataLoader with a DistributedSampler (the DDP tutorials' loader) and by
run.loader's own path (its sampler, plan and seeded fetch), the same batches in alternating
rounds (one fresh iterator each, so worker start-up is in both); a ratio is plain time over
run.loader's time, i.e. run.loader's throughput as a fraction of the plain loader's: the
median over rounds with its 90% interval. "us/sample" is the fetch alone, without a DataLoader.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import ddpkit
from ddpkit.bench.engine_summary import interval90
from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.errors import OneLineParser
from ddpkit.run.data.map_source import EpochIndices, MapSource
from ddpkit.run.invariant.seeding import SeededFetch

_MEAN, _STD = torch.tensor([0.49, 0.48, 0.45]).view(3, 1, 1), torch.tensor([0.25, 0.24, 0.26]).view(3, 1, 1)


class Crops(Dataset):
    """40x40 images cropped to 32x32 at random, flipped at random, normalized."""

    def __init__(self, n: int, own_generator: bool) -> None:
        self.images = np.random.default_rng(0).integers(0, 256, (n, 40, 40, 3), dtype=np.uint8)
        self.labels = torch.arange(n) % 10
        if own_generator:
            self.rng = np.random.default_rng()

    def __len__(self) -> int:
        return len(self.images)

    def _draws(self) -> tuple[int, int, bool]:
        if hasattr(self, "rng"):
            top, left = self.rng.integers(0, 9, 2)
            return int(top), int(left), bool(self.rng.random() < 0.5)
        return random.randrange(9), int(np.random.randint(9)), bool(torch.rand(()) < 0.5)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        top, left, flip = self._draws()
        crop = self.images[i, top : top + 32, left : left + 32]
        if flip:
            crop = crop[:, ::-1]
        x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).float().div_(255)
        return (x - _MEAN) / _STD, self.labels[i]


class SampleRngCrops(Crops):
    """The same crops drawn from ``ddpkit.sample_rng()``: nothing else is watched or put back."""

    draws_random = "sample_rng"

    def __init__(self, n: int) -> None:
        super().__init__(n, own_generator=False)

    def _draws(self) -> tuple[int, int, bool]:
        rng = ddpkit.sample_rng().numpy
        top, left = rng.integers(0, 9, 2)
        return int(top), int(left), bool(rng.random() < 0.5)


# The dataset a plain DataLoader loads instead, where run.loader's is a port of it.
PORTED_FROM = {"sample_rng": "crop"}


class Fixed(Dataset):
    """Ready images, as a TensorDataset, but a class of the user's: it might draw, so it is watched."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images, self.labels = images, torch.arange(len(images)) % 10

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def datasets(n: int) -> dict[str, Dataset]:
    images = torch.randn(n, 3, 32, 32)
    return {
        "tensor": TensorDataset(images, torch.arange(n) % 10),
        "fixed": Fixed(images),
        "crop": Crops(n, own_generator=True),
        "globals": Crops(n, own_generator=False),
        "sample_rng": SampleRngCrops(n),
    }


def _plain_pass(loader: DataLoader, batches: int) -> float:
    start = time.perf_counter()
    for _, _ in zip(range(batches), loader, strict=False):
        pass
    return time.perf_counter() - start


def _run_pass(source: MapSource, batches: int) -> float:
    start = time.perf_counter()
    for _, (_, fetch) in zip(range(batches), source.start_pass(), strict=False):
        fetch()
    return time.perf_counter() - start


def per_sample_us(
    dataset: Dataset, batch: int, rounds: int = 20, original: Dataset | None = None
) -> tuple[float, float]:
    """Microseconds a sample for the dataset's own fetch (``original``'s, for a port) and for the
    seeded one, no DataLoader."""
    seeded, times = SeededFetch(dataset, seed=0), {"plain": [], "seeded": []}
    plain = dataset if original is None else original
    for r in range(rounds):
        indices = EpochIndices((r * batch + k) % len(dataset) for k in range(batch))
        indices.epoch = 0
        fetches = {"plain": lambda ix=indices: [plain[i] for i in ix]}
        fetches["seeded"] = lambda ix=indices: seeded.__getitems__(ix)
        for name, fetch in fetches.items():
            start = time.perf_counter()
            fetch()
            times[name].append((time.perf_counter() - start) / batch * 1e6)
    return statistics.median(times["plain"][1:]), statistics.median(times["seeded"][1:])


def measure(
    dataset: Dataset, batch: int, workers: int, rounds: int, batches: int, original: Dataset | None = None
) -> dict:
    """run.loader on ``dataset`` against a plain DataLoader on it (on ``original``, for a port)."""
    original = dataset if original is None else original
    sampler = DistributedSampler(original, num_replicas=1, rank=0, shuffle=True, seed=0)
    plain = DataLoader(original, batch_size=batch, sampler=sampler, num_workers=workers)
    ours = MapSource(
        dataset, GlobalBatchSampler(len(dataset), batch, 0, 1, seed=0), None, {"num_workers": workers}
    )
    ratios = []
    for r in range(rounds + 1):  # the first round warms up
        if r % 2:
            mine, theirs = _run_pass(ours, batches), _plain_pass(plain, batches)
        else:
            theirs, mine = _plain_pass(plain, batches), _run_pass(ours, batches)
        if r:
            ratios.append(theirs / mine)
    return {"ratio": statistics.median(ratios), "interval90": interval90(ratios)}


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="ddpkit bench data", description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=64, help="batches per round")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--workers", default="0,2", help="DataLoader workers, comma-separated")
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)  # a loader's samples are small; one thread, as in a DataLoader worker
    rows = {}
    print(
        f"# ddpkit bench data: world of one, batch {ns.batch}, {ns.batches} batches a round, "
        f"{ns.rounds} rounds; ratio = run.loader's throughput / plain DataLoader's: median [90% interval]"
    )
    sets = datasets(ns.batch * ns.batches)
    for name, dataset in sets.items():
        original = sets.get(PORTED_FROM.get(name, ""))
        plain_us, seeded_us = per_sample_us(dataset, ns.batch, original=original)
        row = {"plain_us_per_sample": plain_us, "seeded_us_per_sample": seeded_us}
        line = f"{name:<8} fetch {plain_us:6.1f} us/sample, seeded {seeded_us:6.1f}"
        line += f" (+{seeded_us - plain_us:.1f})"
        for workers in map(int, ns.workers.split(",")):
            result = measure(dataset, ns.batch, workers, ns.rounds, ns.batches, original)
            row[f"workers_{workers}"] = result
            low, high = result["interval90"]
            line += f"   {workers} workers {result['ratio']:.3f} [{low:.3f}, {high:.3f}]"
        rows[name] = row
        print(line)
    print("target: crop >= 0.8 with 0 and 2 workers; seeding <= 5 us a sample")
    if ns.json:
        Path(ns.json).write_text(
            json.dumps({k: v for k, v in vars(ns).items() if k != "json"} | {"datasets": rows}, indent=2)
        )
    return 0
