"""Exact metrics over a held-out split whose shards are uneven: nothing padded, nothing counted twice.

Rank r takes samples r, r + world_size, ... (shards differ by at most one sample, and a rank may
have none; with a sharded model, whose forwards are collectives, a rank with fewer batches runs
extra forwards whose results are dropped). Each rank sums ``batch mean * batch size`` per metric
in float64; one ``all_gather_object`` (ranks without a batch know no metric names) adds the sums up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.micro import to_device
from ddpkit.run.sharded import is_sharded, reshard


@torch.no_grad()
def evaluate(
    dataset: Dataset,
    fn: Callable[[Any], Tensor | dict[str, Tensor]],
    env: DistEnv,
    models: list[nn.Module],
    *,
    batch_size: int = 64,
    reduce: str = "mean",
    collate_fn: Callable | None = None,
    num_workers: int = 0,
) -> dict[str, float]:
    """Run ``fn`` on this rank's shard of ``dataset`` and combine the results of every rank.

    Args:
        dataset: a map-style dataset.
        fn: ``fn(batch)`` -> the mean over the batch of one metric (a scalar tensor, returned as
            ``{"value": ...}``) or of several (a dict of scalar tensors).
        env: this process's distributed environment.
        models: put in eval mode meanwhile, then back in the mode they had.
        batch_size: samples per batch on one rank.
        reduce: ``mean`` (over all samples) or ``sum`` (of the per-sample values).
        collate_fn: as for torch's DataLoader.
        num_workers: as for torch's DataLoader.
    """
    if reduce not in ("mean", "sum"):
        raise ConfigError(f"reduce={reduce!r} must be 'mean' or 'sum'")
    mine = Subset(dataset, range(env.rank, len(dataset), env.world_size))
    kwargs = {"collate_fn": collate_fn} if collate_fn is not None else {}
    loader = DataLoader(mine, batch_size=batch_size, num_workers=num_workers, **kwargs)
    modes = [m.training for m in models]
    for model in models:
        model.eval()
    try:
        sums, count = _local_sums(loader, fn, env.device)
        if any(is_sharded(m) for m in models):
            _keep_in_step(dataset, fn, env, len(loader), batch_size, kwargs)
    finally:
        for model, mode in zip(models, modes, strict=True):
            model.train(mode)
            reshard(model)
    everyone: list[tuple | None] = [None] * env.world_size
    dist.all_gather_object(everyone, (sums, count))
    total = sum(n for _, n in everyone)
    names = sorted({name for part, _ in everyone for name in part})
    sums = {name: sum(part.get(name, 0.0) for part, _ in everyone) for name in names}
    return {name: value / total if reduce == "mean" else value for name, value in sums.items()} | {
        "samples": total
    }


def _keep_in_step(
    dataset: Dataset, fn: Callable, env: DistEnv, done: int, batch_size: int, kwargs: dict
) -> None:
    """A sharded model's forward all-gathers its parameters, so every rank must run as many as the
    rank with the most batches (rank 0): the others run ``fn`` on the dataset's first batch for
    the difference, and its result is dropped."""
    most = math.ceil(math.ceil(len(dataset) / env.world_size) / batch_size)
    if most > done:
        filler = next(
            iter(DataLoader(Subset(dataset, range(min(batch_size, len(dataset)))), batch_size, **kwargs))
        )
        for _ in range(most - done):
            fn(to_device(filler, env.device))


def _local_sums(loader: DataLoader, fn: Callable, device: torch.device) -> tuple[dict[str, float], int]:
    sums: dict[str, Tensor] = {}
    count, start = 0, 0
    for batch in loader:
        size = len(loader.dataset.indices[start : start + loader.batch_size])
        start += size
        out = fn(to_device(batch, device))
        for name, value in (out if isinstance(out, dict) else {"value": out}).items():
            sums[name] = sums.get(name, 0.0) + value.detach().double() * size
        count += size
    return {name: float(value) for name, value in sums.items()}, count
