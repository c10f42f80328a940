"""Exact metrics over a held-out split, the same to the bit on any number of processes.

The split is cut into the batches one process would make (``batch_size`` samples in order, the
last one shorter), and batch b goes to rank b % world_size: every world size computes the same
batches, so the same float32 batch means (a rank may have none). Each batch's ``mean * size`` is
kept in float64; one ``all_gather_object`` brings them together and they are added in batch order.
Nothing is padded or counted twice. With a sharded model, whose forwards are collectives, a rank
with one batch fewer runs one more forward on the first batch and drops its result.

(Sharded by sample instead, 2 processes averaged two 15-sample means where 1 averaged one of 30:
0.46666668 against 0.46666667, and an early-stopping comparison of a tie went the other way.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ddpkit.data.workers import check_socket_dir
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.data.map_source import EpochIndices
from ddpkit.run.engine.fsdp import is_sharded, reshard
from ddpkit.run.invariant.seeding import SeededFetch
from ddpkit.run.micro import to_device


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
    seed: int | None = None,
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
        seed: seed a dataset's random draws per sample (run/invariant/seeding.py), from (seed, the sample)
            alone: every evaluation, world size and resume draws the same noise or crops.
    """
    if reduce not in ("mean", "sum"):
        raise ConfigError(f"reduce={reduce!r} must be 'mean' or 'sum'")
    check_socket_dir(num_workers)
    batches = [
        range(start, min(start + batch_size, len(dataset))) for start in range(0, len(dataset), batch_size)
    ]
    mine = list(range(env.rank, len(batches), env.world_size))
    kwargs = {"collate_fn": collate_fn} if collate_fn is not None else {}
    if seed is not None:
        dataset = SeededFetch(dataset, seed)
    mine_batches = [_held_out(batches[b]) for b in mine]
    loader = DataLoader(dataset, batch_sampler=mine_batches, num_workers=num_workers, **kwargs)
    modes = [m.training for m in models]
    for model in models:
        model.eval()
    try:
        parts = [
            (b, len(batches[b]), _sums(batch, fn, env.device, len(batches[b])))
            for b, batch in zip(mine, loader, strict=True)
        ]
        most = len(range(0, len(batches), env.world_size))  # rank 0's
        if any(is_sharded(m) for m in models) and len(mine) < most:
            fn(
                to_device(
                    next(iter(DataLoader(dataset, batch_sampler=[list(batches[0])], **kwargs))), env.device
                )
            )
    finally:
        for model, mode in zip(models, modes, strict=True):
            model.train(mode)
            reshard(model)
    everyone: list[list | None] = [None] * env.world_size
    dist.all_gather_object(everyone, parts)
    ordered = sorted(part for rank_parts in everyone for part in rank_parts)
    total = sum(size for _, size, _ in ordered)
    names = sorted({name for _, _, sums in ordered for name in sums})
    sums = {name: sum(part.get(name, 0.0) for _, _, part in ordered) for name in names}
    return {name: value / total if reduce == "mean" else value for name, value in sums.items()} | {
        "samples": total
    }


def _held_out(indices: range) -> EpochIndices:
    """A batch's indices, keyed apart from every training epoch's (epoch -1) for their draws."""
    tagged = EpochIndices(indices)
    tagged.epoch = -1
    return tagged


def _sums(batch: Any, fn: Callable, device: torch.device, size: int) -> dict[str, float]:
    """``fn``'s means on one batch, times its size, in float64."""
    out = fn(to_device(batch, device))
    sums = {}
    for name, value in (out if isinstance(out, dict) else {"value": out}).items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = torch.tensor(float(value))  # loss.item(): a mean over the batch all the same
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ConfigError(
                f"run.evaluate: fn returned {name}={value!r}; return the batch's mean as a number or a "
                "one-element tensor (or a dict of them)"
            )
        sums[name] = float(value.detach().double() * size)
    return sums
