"""The buffers an engine keeps equal across ranks (BatchNorm's running statistics): every engine
that copies rank 0's buffers to every rank before each forward (``broadcast_buffers``: torch's
DDP, ddpkit's DataParallel, the fsdp engine's hook) does so before a checkpoint too."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.parallel import DataParallel
from ddpkit.parallel.sync import broadcast_coalesced, managed_buffers
from ddpkit.run.engine.fsdp import broadcasts_buffers, is_sharded
from ddpkit.run.engine.wrap import unwrap


def sync_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers now, when the engine around ``model`` does so before each
    forward anyway (broadcast_buffers): a checkpoint then holds the buffers the next forward
    would use on every rank, whichever rank writes them (DCP writes one copy of a replicated
    tensor, from any rank). Collective; nothing on one process or when buffers are the ranks' own."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    engine = model
    while not isinstance(engine, DataParallel | DistributedDataParallel) and hasattr(engine, "_orig_mod"):
        engine = engine._orig_mod  # torch.compile's wrapper, around the engine's
    if isinstance(engine, DataParallel | DistributedDataParallel):
        buffers = managed_buffers(engine.module) if engine.broadcast_buffers else []
    else:
        bare = unwrap(model)
        buffers = list(bare.buffers()) if is_sharded(bare) and broadcasts_buffers(bare) else []
    if buffers:
        broadcast_coalesced(buffers, dist.group.WORLD, 0)
