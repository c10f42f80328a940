"""``run.loader(data)``: the object a user's loop iterates, and what it is built from.

``Loader`` is a thin handle: ``for batch in loader`` hands the run's step cycle its source (a
``MapSource`` for a map-style dataset, a ``StreamSource`` for a stream), and the cycle drives the
pass (``StepCycle.drive``). ``make_source`` builds that source from what the user hands
``run.loader`` (a dataset, a stream or a DataLoader, and DataLoader arguments), checked in one
line each by ``run/data/loader_checks.py`` (a DataLoader's own settings by ``run/data/from_dataloader.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from ddpkit.data.sampler import GlobalBatchSampler, weighted_order
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.config import DataConfig, check_split
from ddpkit.run.data.from_dataloader import batch_size_line
from ddpkit.run.data.loader_checks import Parts, check_stream, is_stream, loader_parts
from ddpkit.run.data.map_source import MapSource
from ddpkit.run.data.stream import StreamSource
from ddpkit.run.invariant import bitwise
from ddpkit.run.step.cycle import StepCycle

log = logging.getLogger(__name__)


class Loader:
    """Iterates this rank's micro-batches, on the run's device, for the rest of the current epoch.

    ``for batch in loader`` runs one epoch (the rest of it after a resume); the next ``for``
    runs the next epoch, so there is no ``set_epoch`` to forget. ``loader.epoch`` is the epoch
    the next ``for`` runs, which makes ``for epoch in range(loader.epoch, epochs)`` resume right.
    Built by ``Run.loader``; see there for the arguments.
    """

    def __init__(self, source: MapSource | StreamSource, cycle: StepCycle) -> None:
        self._source, self._cycle = source, cycle

    @property
    def epoch(self) -> int:
        """The epoch that the next ``for batch in loader`` runs (0-based)."""
        return self._source.epoch

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self._source.global_batch

    @property
    def dataloader(self) -> DataLoader:
        """The torch DataLoader behind it (its workers, pinning and collate_fn are the user's)."""
        return self._source.dataloader

    @property
    def sampler(self) -> GlobalBatchSampler:
        """A map-style dataset's GlobalBatchSampler (a stream has none)."""
        return self._source.sampler

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one epoch (None for a stream, whose passes have no known length)."""
        return self._source.steps_per_epoch

    def __len__(self) -> int:
        """Optimizer steps in one epoch (``steps_per_epoch``): the same number at every point of a
        run, before and after a resume, on any world size and with any ``micro_batch``.

        What a single-device loop's ``len(loader)`` means (one optimizer step per batch), so
        ``epochs * len(loader)`` sizes a schedule right. Iterating yields micro-batches: with
        ``micro_batch`` below a rank's share of the global batch, more than ``len`` of them.
        """
        if self._source.steps_per_epoch is None:
            raise TypeError(
                "a stream has no length to size a schedule by: give ddpkit.Run steps=N and size it by that"
            )
        return self._source.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        return self._cycle.drive(self._source)

    def state_dict(self) -> dict:
        """The position the run's checkpoints hold (what the world consumed, not what was prefetched)."""
        return self._source.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Continue from a saved position (a checkpoint's; the run does this itself on resume)."""
        self._source.load_state_dict(state)


def make_source(
    data: Dataset | DataLoader, kwargs: dict, cfg: DataConfig, env: DistEnv, seed: int
) -> MapSource | StreamSource:
    """The source of ``run.loader(data, **kwargs)``: a stream's, or a map-style dataset's over the
    run's global-batch sampler (drawn by ``weights=`` when given)."""
    weights, inexact = kwargs.pop("weights", None), kwargs.pop("inexact_resume", False)
    parts = loader_parts(data, cfg, env.device, kwargs, seed)
    check_split(parts.global_batch, env.world_size)
    micro_batch = cfg.micro_batch
    if cfg.bitwise:
        micro_batch = bitwise.grain_size(parts.global_batch, cfg.grains, cfg.micro_batch)
    if is_stream(parts.dataset):
        if cfg.bitwise:
            raise ConfigError(
                "bitwise=True cuts a map-style dataset's global batches into grains; a stream's "
                "samples are split by rank as they are read: give run.loader a map-style dataset"
            )
        buffer = check_stream(parts.dataset, weights, inexact)
        source = StreamSource(env, parts.dataset, parts.global_batch, micro_batch, parts.kwargs)
        source.inexact_buffer = buffer
    else:
        sampler = make_sampler(parts, env, seed, weights)
        if cfg.bitwise:
            bitwise.check_epoch(sampler.num_samples, parts.global_batch, sampler.drop_last)
        source = MapSource(
            parts.dataset, sampler, micro_batch, parts.kwargs, cfg.grains if cfg.bitwise else None
        )
    if parts.batch_size_taken and env.is_rank0:  # the same on every rank: said once
        log.info("%s", batch_size_line(parts.global_batch, env.world_size, micro_batch))
    return source


def make_sampler(parts: Parts, env: DistEnv, seed: int, weights: Any = None) -> GlobalBatchSampler:
    """The run's GlobalBatchSampler over a map-style dataset, by its shuffle and drop_last."""
    dataset = parts.dataset
    order = getattr(dataset, "epoch_order", None)  # ddpkit.data.Shards: shard by shard
    if weights is not None:
        order = weighted_order(weights, len(dataset))
    return GlobalBatchSampler(
        len(dataset),
        parts.global_batch,
        env.rank,
        env.world_size,
        seed=seed,
        shuffle=parts.shuffle,
        drop_last=parts.drop_last,
        order=order,
    )
