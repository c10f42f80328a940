"""``run.loader(stream)``: an iterable source (an IterableDataset, a HuggingFace streaming dataset,
a generator) cut into the run's global batches, with what resume it allows.

Each rank reads its own part of the stream: a HuggingFace ``datasets.IterableDataset`` through
``split_dataset_by_node`` (whole shards per rank when they divide evenly), anything else by taking
every world_size-th sample (and every num_workers-th of those in each DataLoader worker). A step
is one global batch: each rank's share, in micro-batches. Before each step the ranks agree that
every one of them has a whole share (one all_reduce of one number), so at the end of a pass they
stop at the same step, on the last full global batch, and none waits for another.

Resume, by what the source can tell:
- a source with ``state_dict()``/``load_state_dict()`` is read through torchdata's
  ``StatefulDataLoader``, which asks each DataLoader worker for the source's state with every
  batch it hands over, so the position saved is the last batch the loop took, never what the
  workers prefetched. Each rank's position is its own: the run resumes exactly, on the same world
  size (another one is refused in one line);
- a plain iterable has no position: a resumed run starts it over and says so once.
For world-size invariant streams use ``ddpkit.data.Shards``: its order is decided by the seed,
the epoch and the shard index alone, and it goes through ``run.loader`` like any dataset.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ddpkit.errors import ConfigError
from ddpkit.run.loader import Micro, to_device

if TYPE_CHECKING:
    from ddpkit.run.run import Run

log = logging.getLogger(__name__)


def is_stream(data: Any) -> bool:
    """An iterable source rather than a map-style dataset (or a DataLoader over one)."""
    data = data.dataset if isinstance(data, DataLoader) else data
    return isinstance(data, IterableDataset) or (
        hasattr(data, "__iter__") and not hasattr(data, "__getitem__")
    )


def has_state(source: Any) -> bool:
    return callable(getattr(source, "state_dict", None)) and callable(
        getattr(source, "load_state_dict", None)
    )


class _RankPart(IterableDataset):
    """Every ``world_size * workers``-th sample of ``source``: this rank's, and this worker's, part.

    Its state (when the source has one) is the source's with the count of samples read, taken in
    the worker that read them, so torchdata's StatefulDataLoader can hand it over with each batch.
    """

    def __init__(self, source: Any, rank: int, world_size: int) -> None:
        self.source, self.rank, self.world_size = source, rank, world_size
        self._read = 0  # samples of the source read so far in this pass, by this process

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        workers, wid = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        parts, mine = self.world_size * workers, self.rank * workers + wid
        for sample in iter(self.source):
            self._read += 1
            if (self._read - 1) % parts == mine:
                yield sample
        self._read = 0

    def state_dict(self) -> dict:
        return {"source": self.source.state_dict(), "read": self._read}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["source"])
        self._read = state["read"]


def rank_part(source: Any, rank: int, world_size: int) -> Any:
    """This rank's part of the stream: HuggingFace's own split for its datasets, else every N-th sample."""
    if type(source).__module__.startswith("datasets.") and hasattr(source, "n_shards"):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(source, rank=rank, world_size=world_size)
    return _RankPart(source, rank, world_size)


class StreamLoader:
    """This rank's micro-batches of a stream; built by ``Run.loader`` for an iterable source.

    ``for batch in loader`` runs one pass over the stream (the rest of it after a resume);
    ``loader.epoch`` counts passes. An endless stream never ends a pass: give ``ddpkit.Run`` a
    ``steps`` limit. A stream has no length to size a schedule by: use ``steps``.
    """

    per_rank_state = True  # a checkpoint holds each rank's position (state.save gathers them)

    def __init__(
        self, run: Run, source: Any, global_batch: int, micro_batch: int | None, kwargs: dict
    ) -> None:
        env = run.env
        share = global_batch // env.world_size
        size = micro_batch or share
        if share % size:
            raise ConfigError(
                f"micro_batch={size} must divide a rank's share of the global batch ({share}) for a stream; "
                f"use a divisor of {share}"
            )
        self.run, self.global_batch, self.size, self.per_step = run, global_batch, size, share // size
        self.stateful = has_state(source)
        part = rank_part(source, env.rank, env.world_size)
        if self.stateful:
            try:
                from torchdata.stateful_dataloader import StatefulDataLoader

                # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates, once per pass.
                warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            except ImportError:
                raise ConfigError(
                    'a stream with state_dict() resumes through torchdata: pip install "ddpkit[streaming]"'
                ) from None
            self.dataloader = StatefulDataLoader(part, batch_size=size, drop_last=True, **kwargs)
        else:
            self.dataloader = DataLoader(part, batch_size=size, drop_last=True, **kwargs)
        self.epoch, self.steps_in_epoch = 0, 0
        self._boundary: dict | None = None  # the dataloader's state at the last step boundary
        self._pending: dict | None = None  # a saved position to load before the next pass
        self._told = False

    def __len__(self) -> int:
        raise TypeError(
            "a stream has no length to size a schedule by: give ddpkit.Run steps=N and size it by that"
        )

    @property
    def steps_per_epoch(self) -> None:
        return None  # unknown until a pass ends

    def __iter__(self) -> Iterator[Any]:
        run = self.run
        run._start_epoch()  # the loop's first batch: a resumed run loads its position here
        cycle, device = run.cycle, run.device
        self._start_pass()
        run.monitor.epoch_started(self.epoch, self.steps_in_epoch, None, cycle.steps)
        batches = iter(self.dataloader)
        while True:
            self._boundary = self.dataloader.state_dict() if self.stateful else None
            step = self._take_step(batches)
            if not self._everyone_has(step is not None):
                break  # the last full global batch is done: every rank ends the pass here
            for i, batch in enumerate(step):
                micro = Micro([], self.size * run.env.world_size / self.global_batch, self.size,
                              i == 0, i == self.per_step - 1, self.steps_in_epoch + 1)  # fmt: skip
                if micro.first and not cycle.begin(self):
                    return  # the run's step limit is reached
                cycle.enter(micro)
                yield to_device(batch, device) if device.type != "cpu" else batch
        cycle.finish()
        cycle.outside = True
        self.epoch, self.steps_in_epoch, self._boundary = self.epoch + 1, 0, None

    def _start_pass(self) -> None:
        if self._pending is not None and self.stateful:
            self.dataloader.load_state_dict(self._pending)
        self._pending = None
        dataset = self.dataloader.dataset
        if hasattr(dataset, "set_epoch"):  # HuggingFace: a new shuffle each pass
            dataset.set_epoch(self.epoch)

    def _take_step(self, batches: Iterator[Any]) -> list | None:
        step = []
        for _ in range(self.per_step):
            batch = next(batches, None)
            if batch is None:
                return None
            step.append(batch)
        return step

    def _everyone_has(self, mine: bool) -> bool:
        flag = torch.tensor(
            [1 if mine else 0], device=self.run.device if self.run.env.backend == "nccl" else "cpu"
        )
        self.run.monitor.phase(self.run.step, "data: every rank has a full share, all_reduce")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _advance_to(self, steps_in_epoch: int) -> None:
        """The step that took the pass to ``steps_in_epoch`` steps is done."""
        self.steps_in_epoch = steps_in_epoch

    def state_dict(self) -> dict:
        """This rank's position: the stream's state at the last step's end (not what was prefetched)."""
        state = {"epoch": self.epoch, "steps": self.steps_in_epoch, "global_batch": self.global_batch}
        return state | ({"stream": self._boundary or self.dataloader.state_dict()} if self.stateful else {})

    def load_state_dict(self, everyone: list[dict]) -> None:
        """Continue from each rank's saved position; a world size the positions were not saved on,
        or another global batch, is refused in one line."""
        env = self.run.env
        if len(everyone) != env.world_size:
            raise ConfigError(
                f"the checkpoint's stream positions are of {len(everyone)} ranks, this run has "
                f"{env.world_size}: a stream resumes on the world size it was saved on "
                "(ddpkit.data.Shards resumes on any)"
            )
        state = everyone[env.rank]
        if state["global_batch"] != self.global_batch:
            raise ConfigError(
                f"the checkpoint was made with global_batch={state['global_batch']}, this run has "
                f"{self.global_batch}; resume with the same global batch, or start another out"
            )
        self.epoch, self.steps_in_epoch = state["epoch"], state["steps"]
        if self.stateful:
            self._pending = state["stream"]
        elif not self._told and env.is_rank0:
            self._told = True
            log.warning(
                "the stream has no state_dict(), so this resumed run reads it from its beginning "
                "(model, optimizer and step %d continue)",
                self.run.cycle.step,
            )
