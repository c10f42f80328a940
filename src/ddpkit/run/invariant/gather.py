"""``run.all_gather``: every rank's rows of a step in global-batch order, with gradients.

A loss over the whole batch (InfoNCE with in-batch negatives, CLIP) on one device sees every
sample's embedding. Under data parallelism each rank sees its share only, unless it gathers the
others': with a gather whose backward sums every rank's gradient for a row back to the rank that
holds it, each rank's loss over the gathered batch, weighted by ``run.backward`` as usual, gives
one process's gradient (the engine's average over ranks and the loss's scale cancel out).

It is exact only when each rank's share of the step is one micro-batch: with a smaller
``micro_batch`` a micro-batch's negatives would be its own and the other ranks' same-numbered
micro-batches', never the whole global batch (GradCache's embedding cache is what that needs);
that is refused in one line. A rank without samples in an epoch's last batch gives no rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.micro import Micro


def all_gather(x: torch.Tensor, micro: Micro | None, env: DistEnv) -> torch.Tensor:
    """Every rank's ``x[:samples]`` concatenated in rank order (the global batch's), differentiable."""
    if micro is None:
        raise ConfigError("run.all_gather gathers a step's rows; call it inside run.loader's loop")
    if not (micro.first and micro.last):
        raise ConfigError(
            "run.all_gather needs each rank's share of a step in one micro-batch, or its negatives "
            "are a micro-batch's only; raise micro_batch to global_batch / world_size (or unset it)"
        )
    mine = x[: micro.samples]
    if env.world_size == 1:
        return mine
    return _Gather.apply(mine.contiguous(), env.world_size)


class _Gather(torch.autograd.Function):
    """all_gather of rows that may differ in number between ranks; backward sums every rank's
    gradient of the gathered rows (all_reduce) and keeps this rank's own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, world_size: int) -> torch.Tensor:
        sizes = torch.tensor([x.shape[0]], device=x.device)
        every = [torch.empty_like(sizes) for _ in range(world_size)]
        dist.all_gather(every, sizes)
        counts = [int(n) for n in torch.cat(every).tolist()]  # the shares of an uneven last batch
        padded = x.new_zeros((max(counts), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(parts, padded)
        ctx.counts, ctx.rank = counts, dist.get_rank()
        return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every rank's loss's gradient for every row, summed
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None
