"""Checks and conversions behind ``run.setup`` and ``run.loader``: what the user hands in, made usable."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ddpkit.checkpoint.files import save_weights as _save_atomic
from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.diagnostics import check_replicas_agree
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.loader import DataConfig, dataloader_kwargs

# DataLoader attributes that run.loader carries over from a DataLoader the user built.
_CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "persistent_workers",
    "worker_init_fn",
    "multiprocessing_context",
)
_DEFAULTS = {
    "num_workers": 0,
    "collate_fn": None,
    "pin_memory": False,
    "persistent_workers": False,
    "prefetch_factor": None,
    "worker_init_fn": None,
    "multiprocessing_context": None,
}


def check_same_model(model: nn.Module, env: DistEnv) -> None:
    """Refuse, on every rank, a model whose parameters differ between ranks (shapes, then values)."""
    if env.world_size == 1:
        return
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    everyone: list[list | None] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            diff = next((a, b) for a, b in zip([*everyone[0], None], [*theirs, None], strict=False) if a != b)
            raise ConfigError(
                f"run.setup: rank {rank}'s model differs from rank 0's at parameter {diff[1]} "
                f"(rank 0 has {diff[0]}); build the same model on every rank"
            )
    try:
        check_replicas_agree(model, env, "at run.setup")
    except RuntimeError as exc:
        raise ConfigError(
            f"{exc}. ddpkit.Run seeds every rank alike before you build the model: do not seed per rank "
            "or load per-rank weights before run.setup"
        ) from None


def loader_parts(
    data: Dataset | DataLoader, cfg: DataConfig, device: torch.device, kwargs: dict
) -> tuple[Dataset, int, dict, bool]:
    """(dataset, global batch, DataLoader arguments, shuffle) from a Dataset or a user's DataLoader."""
    shuffle = cfg.shuffle
    global_batch = cfg.global_batch
    if isinstance(data, DataLoader):
        if not isinstance(data.dataset, IterableDataset):  # a stream's DataLoader has no sampler to replace
            _check_own_sampler(data)
        carried = {name: getattr(data, name) for name in _CARRIED}
        if data.num_workers > 0:
            carried["prefetch_factor"] = data.prefetch_factor
        kwargs = {**carried, **kwargs}
        shuffle = isinstance(data.sampler, RandomSampler)
        global_batch = global_batch or data.batch_size
        data = data.dataset
    stream = isinstance(data, IterableDataset) or (
        hasattr(data, "__iter__") and not hasattr(data, "__getitem__")
    )
    if not stream and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ConfigError(
            f"run.loader needs a dataset (__len__ and __getitem__) or an iterable, got {type(data).__name__}"
        )
    if global_batch is None:
        raise ConfigError("ddpkit.Run needs global_batch=N (samples per optimizer step over all ranks)")
    kwargs.setdefault("pin_memory", device.type == "cuda")
    unknown = sorted(set(kwargs) - set(_DEFAULTS))
    if unknown:
        raise ConfigError(f"run.loader got unknown arguments {unknown}; it takes {sorted(_DEFAULTS)}")
    return data, global_batch, dataloader_kwargs(**{**_DEFAULTS, **kwargs}), shuffle


def _check_own_sampler(loader: DataLoader) -> None:
    sampler_ok = isinstance(loader.sampler, RandomSampler | SequentialSampler)
    if not sampler_ok or not isinstance(loader.batch_sampler, BatchSampler | None):
        raise ConfigError(
            f"run.loader replaces the DataLoader's sampler ({type(loader.sampler).__name__}) with ddpkit's "
            "global-batch sampler; build the DataLoader with batch_size and shuffle only, no sampler="
        )


def make_sampler(
    dataset: Dataset, global_batch: int, env: DistEnv, cfg: DataConfig, seed: int, shuffle: bool
):
    """The run's GlobalBatchSampler, after checking that the global batch splits over the ranks."""
    check_split(global_batch, env.world_size)
    return GlobalBatchSampler(
        len(dataset),
        global_batch,
        env.rank,
        env.world_size,
        seed=seed,
        shuffle=shuffle,
        drop_last=cfg.drop_last,
        order=getattr(dataset, "epoch_order", None),  # ddpkit.data.Shards: shard by shard
    )


def save_weights(module: nn.Module, path: Path) -> None:
    """Rank 0: the bare model's state_dict to ``path`` (loadable with ``weights_only=True``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _save_atomic(module.state_dict(), path)


def check_split(global_batch: int, world_size: int) -> None:
    """Fail unless ``global_batch`` splits evenly over ``world_size`` ranks, naming the sizes that work."""
    if global_batch % world_size == 0:
        return
    works = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    raise ConfigError(
        f"global_batch={global_batch} cannot be split evenly across {world_size} processes; "
        f"use a global batch that is a multiple of {world_size}, or a world size in {works}"
    )


def load_weights(model: nn.Module, weights: dict, name: str, path: str | None) -> None:
    """The checkpoint's weights into ``model``, or one line saying it holds another model."""
    mine, theirs = model.state_dict(), weights
    missing = [k for k in mine if k not in theirs]
    unexpected = [k for k in theirs if k not in mine]
    shapes = [k for k in mine if k in theirs and mine[k].shape != theirs[k].shape]
    if missing or unexpected or shapes:
        first = (missing or unexpected or shapes)[0]
        raise ConfigError(
            f"cannot resume {name!r} from {path}: it holds another model ({len(missing)} of this model's "
            f"tensors missing, {len(unexpected)} unknown, {len(shapes)} of another shape; first {first!r}); "
            "resume from a checkpoint of this model, or start a new out"
        )
    model.load_state_dict(weights)


def kind_of(obj: Any) -> str:
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
        return "scheduler"
    return "scaler" if isinstance(obj, torch.amp.GradScaler) else type(obj).__name__.lower()


def seed_everything(seed: int) -> None:
    """The same seed on every rank: identical model init, so the engine's broadcast changes nothing."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
