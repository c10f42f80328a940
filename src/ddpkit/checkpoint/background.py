"""Checkpoints written by a background thread: the step waits only for a copy of the state.

``async_save=True``: at a save, rank 0 copies every tensor of its state.pt into host memory of
its own and hands the copy to one thread, which writes it as a synchronous save would: into a
hidden temporary folder, hashed as it is written, the manifest last, then renamed into place. So
a kill during the write leaves a temporary folder that is never loaded, and the previous
checkpoint stands. A sharded save (fsdp) does the same on every rank with its shards, through
DCP's ``async_save`` (dcp.py).

The copies are DCP's staging (``DefaultStager``), one stager a run: pinned host memory when the
run is on a GPU (so the copy does not wait for a pageable buffer), made at the first save and
refilled by every later one, instead of allocating (and pinning) the state's size again at each
save. The buffers stay for the run: the state's size again in host memory.

One write at a time: a save waits for the one before it to land. ``wait`` (at ``run.finish()``,
before a preempted run exits) waits for the last; an error of the thread's (a full disk) is
raised there, or at the next save.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class BackgroundWriter:
    """One thread at a time that writes a checkpoint; ``submit`` waits for the one before."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.group: Any = None  # a sharded save's gloo group for its threads' collectives (dcp.py)
        self._stager: Any = None

    @property
    def stager(self) -> Any:
        """The run's DCP ``DefaultStager``: host copies whose buffers later saves refill (pinned
        when the run is on a GPU). A copy is refilled only once the write before it has landed:
        every save waits for the last write before it stages."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
            options = StagingOptions(
                use_pinned_memory=gpu,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=gpu,
            )
            self._stager = DefaultStager(options)
        return self._stager

    def copy(self, state: Any) -> Any:
        """``state`` with every tensor copied into the stager's host memory (non-tensors deep-copied),
        so training may change the originals while the copy is written."""
        return self.stager.stage(state)

    def submit(self, write: Callable[[], Any]) -> None:
        """Start ``write()`` in the background, once the previous write has landed."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # raised in the training thread at the next wait
                self.error = exc

        # Not a daemon: an interpreter that exits normally lets the write land first.
        self.thread = threading.Thread(target=run, name="ddpkit-checkpoint-writer")
        self.thread.start()

    def wait(self) -> None:
        """Until the last write has landed; its error, if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()
