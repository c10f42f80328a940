"""Checkpoints written by a background thread: the step waits only for a copy of the state.

``async_save=True``: at a save, rank 0 copies every tensor of its state.pt into host memory of
its own (pinned on a GPU, so the copy does not wait for a pageable buffer) and hands the copy to
one thread, which writes it as a synchronous save would: into a hidden temporary folder, hashed
as it is written, the manifest last, then renamed into place. So a kill during the write leaves
a temporary folder that is never loaded, and the previous checkpoint stands. A sharded save
(fsdp) does the same on every rank with its shards, through DCP's ``async_save`` (dcp.py).

One write at a time: a save waits for the one before it to land. ``wait`` (at ``run.finish()``,
before a preempted run exits) waits for the last; an error of the thread's (a full disk) is
raised there, or at the next save.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map


def host_copy(state: Any) -> Any:
    """``state`` with every tensor copied into memory nothing else holds (pinned host memory for a
    GPU's), so training may change the originals while the copy is written."""
    pending = False

    def copy_leaf(value: Any) -> Any:
        nonlocal pending
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        if value.device.type == "cpu":
            return value.detach().clone()
        pending = True
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        return host.copy_(value.detach(), non_blocking=True)

    copied = tree_map(copy_leaf, state)
    if pending:
        torch.cuda.synchronize()  # the copies have landed before the originals move on
    return copied


class BackgroundWriter:
    """One thread at a time that writes a checkpoint; ``submit`` waits for the one before."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.group: Any = None  # a sharded save's gloo group for its threads' collectives (dcp.py)

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
