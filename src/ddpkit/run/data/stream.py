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
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.config import check_same_global_batch
from ddpkit.run.micro import Micro

log = logging.getLogger(__name__)


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


class StreamSource:
    """This rank's micro-batches of a stream, pass by pass, and its position.

    A pass runs to the stream's end (the rest of it after a resume); ``epoch`` counts passes. An
    endless stream never ends a pass: give ``ddpkit.Run`` a ``steps`` limit. A stream has no
    length to size a schedule by: use ``steps``.

    Args:
        env: this process's distributed environment.
        source: the stream.
        global_batch: samples per step over all ranks.
        micro_batch: samples per forward/backward on one rank; None: the whole share.
        kwargs: torch DataLoader arguments.
    """

    per_rank_state = True  # a checkpoint holds each rank's position (checkpoints.save gathers them)
    # The collective before each step's first micro-batch (``_everyone_has``): the step cycle
    # names it to the hang watchdog before it asks for the step.
    agreement = "data: every rank has a full share, all_reduce"

    def __init__(
        self,
        env: DistEnv,
        source: Any,
        global_batch: int,
        micro_batch: int | None,
        kwargs: dict,
    ) -> None:
        share = global_batch // env.world_size
        size = micro_batch or share
        if share % size:
            raise ConfigError(
                f"micro_batch={size} must divide a rank's share of the global batch ({share}) for a stream; "
                f"use a divisor of {share}"
            )
        self.env, self.global_batch, self.size, self.per_step = env, global_batch, size, share // size
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
        self._told = False  # the position is loaded at run.loader and again at the first batch
        self.inexact_buffer: int | None = None  # run.loader(inexact_resume=True) of a shuffled stream

    @property
    def steps_per_epoch(self) -> None:
        return None  # unknown until a pass ends

    @property
    def steps_done(self) -> int:
        """Steps of the current pass already taken."""
        return self.steps_in_epoch

    def start_pass(self) -> Iterator[tuple[Micro, Callable[[], Any]]]:
        """The rest of the current pass: each micro-batch with the call that hands over its batch.

        A step's batches are all read, and the ranks agree that each has a whole share, before
        its first micro-batch is handed over: the step cycle times that as data."""
        if self._pending is not None and self.stateful:
            self.dataloader.load_state_dict(self._pending)
        self._pending = None
        dataset = self.dataloader.dataset
        if hasattr(dataset, "set_epoch"):  # HuggingFace: a new shuffle each pass
            dataset.set_epoch(self.epoch)
        return self._micro_batches(iter(self.dataloader), self.steps_in_epoch)

    def _micro_batches(self, batches: Iterator[Any], taken: int) -> Iterator[tuple[Micro, Callable[[], Any]]]:
        scale = self.size * self.env.world_size / self.global_batch
        while True:
            self._boundary = self.dataloader.state_dict() if self.stateful else None
            step = self._take_step(batches)
            if not self._everyone_has(step is not None):
                return  # the last full global batch is done: every rank ends the pass here
            taken += 1
            for i, batch in enumerate(step):
                offset = (self.env.rank * self.per_step + i) * self.size  # its place in the step
                micro = Micro([], scale, self.size, i == 0, i == self.per_step - 1, taken, offset)
                yield micro, (lambda batch=batch: batch)

    def end_pass(self) -> None:
        """The pass is over and its last step closed: the next pass starts at its beginning."""
        self.epoch, self.steps_in_epoch, self._boundary = self.epoch + 1, 0, None

    def _take_step(self, batches: Iterator[Any]) -> list | None:
        step = []
        for _ in range(self.per_step):
            batch = next(batches, None)
            if batch is None:
                return None
            step.append(batch)
        return step

    def _everyone_has(self, mine: bool) -> bool:
        flag = torch.tensor([1 if mine else 0], device=self.env.collective_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def advance_to(self, steps_in_epoch: int) -> None:
        """The step that took the pass to ``steps_in_epoch`` steps is done."""
        self.steps_in_epoch = steps_in_epoch

    def state_dict(self) -> dict:
        """This rank's position: the stream's state at the last step's end (not what was prefetched)."""
        state = {"epoch": self.epoch, "steps": self.steps_in_epoch, "global_batch": self.global_batch}
        return state | ({"stream": self._boundary or self.dataloader.state_dict()} if self.stateful else {})

    def load_state_dict(self, everyone: list[dict]) -> None:
        """Continue from each rank's saved position; a world size the positions were not saved on,
        or another global batch, is refused in one line."""
        if len(everyone) != self.env.world_size:
            raise ConfigError(
                f"the checkpoint's stream positions are of {len(everyone)} ranks, this run has "
                f"{self.env.world_size}: a stream resumes on the world size it was saved on "
                "(ddpkit.data.Shards resumes on any)"
            )
        state = everyone[self.env.rank]
        check_same_global_batch(state["global_batch"], self.global_batch)
        self.epoch, self.steps_in_epoch = state["epoch"], state["steps"]
        if self.stateful:
            self._pending = state["stream"]
            if self.inexact_buffer is not None and not self._told and self.env.is_rank0:
                self._told = True  # run.loader(inexact_resume=True) of a shuffled stream
                log.warning(
                    "the stream's shuffle buffer (%d samples a rank) is not in its checkpoint: this "
                    "resumed run skips what it held and reads the rest in another order",
                    self.inexact_buffer,
                )
        elif not self._told and self.env.is_rank0:
            self._told = True
            log.warning(
                "the stream has no state_dict(), so this resumed run reads it from its beginning "
                "(model, optimizer and the step continue)"
            )
