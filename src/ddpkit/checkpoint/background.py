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

A sharded save's shards are staged in the background too (``use_async_staging``): on a GPU a
thread copies them on a stream of its own while the next step's forward and backward run, and
the step waits for the copy (``wait_staged``) only before anything changes what is being copied:
the optimizer step (the gate's, run/step/optim.py), an average's update, or the next forward when
a model has buffers a forward may change (BatchNorm's running statistics). The device's queue is
drained first (``torch.accelerator.synchronize``), so the side stream copies the updated weights.

One write at a time: a save waits for the one before it to land. ``wait`` (at ``run.finish()``,
before a preempted run exits) waits for the last; an error of the thread's (a full disk) is
raised there, or at the next save.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch


class BackgroundWriter:
    """One thread at a time that writes a checkpoint; ``submit`` waits for the one before."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.group: Any = None  # a sharded save's gloo group for its threads' collectives (dcp.py)
        self.staged: Future | None = None  # the shards' copy into host memory, until it is done
        self._stager: Any = None
        self._state_stager: Any = None

    @property
    def stager(self) -> Any:
        """The run's DCP ``DefaultStager`` for sharded saves: host copies whose buffers later saves
        refill (pinned when the run is on a GPU), made in a thread of their own. A copy is refilled
        only once the write before it has landed: every save waits for the last write first."""
        if self._stager is None:
            self._stager = _stager(background=True)
        return self._stager

    def copy(self, state: Any) -> Any:
        """``state`` with every tensor copied into host memory (non-tensors deep-copied), now, so
        training may change the originals while the copy is written: rank 0's state.pt, whose
        objects' ``state_dict()`` may hand back what the loop goes on changing."""
        if self._state_stager is None:
            self._state_stager = _stager(background=False)
        return self._state_stager.stage(state)

    def stage_synchronize(self) -> None:
        """Before a background copy on a device: what the device has queued (the step that just
        ended) finishes first, so the copy's own stream reads the weights it wrote."""
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def wait_staged(self) -> None:
        """Until the shards' copy into host memory is done (nothing when none is under way): before
        the weights, the optimizer's state or a model's buffers change."""
        staged, self.staged = self.staged, None
        if staged is not None:
            staged.result()

    def submit(self, write: Callable[[], Any]) -> None:
        """Start ``write()`` in the background, once the previous write has landed (not waiting
        for the copy ``write`` itself writes, which may be under way: ``staged``)."""
        self._join()

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
        self.wait_staged()
        self._join()

    def _join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def _stager(background: bool) -> Any:
    """A DCP ``DefaultStager``: pinned host memory and non-blocking copies when the run is on a GPU;
    ``background``: the copy in a thread of its own (on a GPU, on a stream of its own)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    options = StagingOptions(
        use_pinned_memory=gpu,
        use_shared_memory=False,
        use_async_staging=background,
        use_non_blocking_copy=gpu,
    )
    return DefaultStager(options)
