"""Uneven inputs: a rank that runs out of batches shadows the others' collectives until all are done.

Built on torch's generic ``Join`` context manager: every forward of a rank that still has data
first all-reduces a 1 (``Join.notify_join_context``); a rank that has left its loop sits in
``Join.__exit__``, all-reduces a 0 to match it, and then runs ``main_hook``, which issues the same
collectives, in the same order, as one training step of ``DataParallel`` does:

    rebuild broadcast (once) -> buffer broadcast -> "will you sync?" all-reduce -> gradient buckets

When the all-reduced count of ranks with data is 0, every rank runs ``post_hook``: the model of a
rank that trained longest is broadcast, so all ranks leave with the same parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import JoinHook, _JoinConfig

from ddpkit.parallel.passes import all_reduce_used
from ddpkit.parallel.sync import broadcast_coalesced

if TYPE_CHECKING:
    from ddpkit.parallel.reducer import Reducer


class JoinedModel(Protocol):
    """What this module reads and sets on the model it shadows: a ``DataParallel``, which imports
    this module and so is named here by what it offers rather than by its class."""

    module: nn.Module
    reducer: Reducer
    process_group: dist.ProcessGroup
    sync_buffers_next: bool  # whether the next forward broadcasts the buffers
    _join_config: _JoinConfig  # torch's Joinable state

    @property
    def has_buffers_to_sync(self) -> bool: ...

    @property
    def join_device(self) -> torch.device: ...


def agree_on_rank(model: JoinedModel, candidate: bool) -> int:
    """The highest group rank among those with ``candidate`` True (an all-reduce MAX)."""
    group = model.process_group
    rank = torch.tensor([dist.get_rank(group) if candidate else -1], device=model.join_device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=group)
    return int(rank.item())


def agree_to_sync(model: JoinedModel, will_sync: bool) -> bool:
    """Tell joined ranks whether this step synchronizes gradients; True if any rank does."""
    flag = torch.tensor([1.0 if will_sync else 0.0], device=model.join_device)
    dist.all_reduce(flag, group=model.process_group)
    return bool(flag.item() > 0)


class DataParallelJoinHook(JoinHook):
    """Shadows one ``DataParallel`` step per call on a rank that has no batches left.

    Args:
        model: the joined rank's ``DataParallel``.
    """

    def __init__(self, model: JoinedModel) -> None:
        self.model = model

    def main_hook(self) -> None:
        model = self.model
        model.reducer.rebuild_buckets()
        if model.sync_buffers_next:
            # Rank 0 may have joined already with stale buffers: take a rank still training.
            broadcast_coalesced(model.module.buffers(), model.process_group, agree_on_rank(model, False))
        should_sync = agree_to_sync(model, False)
        # The ranks still training set this from their own last forward; mirror it.
        model.sync_buffers_next = should_sync and model.has_buffers_to_sync
        if should_sync:
            shadow_backward(model.reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        model = self.model
        src = agree_on_rank(model, is_last_joiner)
        state = list(model.module.parameters()) + list(model.module.buffers())
        broadcast_coalesced(state, model.process_group, src)
        # Leave join mode: later forwards outside the context send no more join all-reduces.
        model._join_config = _JoinConfig.construct_disabled_join_config()


def shadow_backward(reducer: Reducer) -> None:
    """On a rank that ran out of data: issue the collectives of one backward, with zeros.

    Its own gradients are overwritten with zeros (the bucket buffers are reused); they are
    stale anyway, and the final model is broadcast from a rank that kept training.
    """
    if reducer.uses_used_map:  # the training ranks start it before their first bucket
        all_reduce_used([False] * len(reducer.params), reducer.params[0].device, reducer.group)[0].wait()
    serial = getattr(reducer.hook, "serial", False)
    for bucket in reducer.buckets:
        bucket.zero_for_join()
        bucket.launch(reducer.hook, reducer.group, reducer.world_size)
        if serial:  # its Future's callbacks may start collectives: finish them first
            bucket.wait()
    for bucket in (b for b in reducer.buckets if b.launched):
        bucket.wait()
    if reducer.arrival is not None:
        reducer.rebuild_pending = True
    if reducer.trial is not None:  # counted like the training ranks' pass, so rebuilds line up
        reducer.trial.pass_done(None)
