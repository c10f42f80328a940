"""What one ``run.backward`` weighs its loss by, so a step is one process's update on the global batch.

A step's gradient is the sum, over ranks and micro-batches, of each backward's scaled loss,
averaged over the ranks by the engine. What each loss must be scaled by depends on what it is:

- ``reduction="mean"`` (the default: ``F.cross_entropy(out, y)``): the mean over the micro-batch's
  samples, weighted by its share of the global batch (``Micro.scale``);
- ``reduction="sum"`` (``reduction="sum"``, a VAE's summed terms): the sum over its samples, which
  adds up to the sum over the global batch once the engine's average is undone (x world size);
- ``count=n`` (a mean over tokens with ``ignore_index``, a class-weighted mean): the numerator
  alone, a sum over the micro-batch's ``n`` items; the step's gradient is a sum until its last
  backward, then divided by the global batch's count, which one all-reduce of one number gives.
  transformers fixed the same bug for gradient accumulation in 2024 (``num_items_in_batch``).

A rank that holds no samples of an epoch's last batch runs a stand-in sample at weight 0: its
loss, count and logged values count for nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.engine.wrap import unwrap
from ddpkit.run.micro import Micro

REDUCTIONS = ("mean", "sum")


class StepLosses:
    """The losses of the open step: each backward's scale, and the step's item count (``count=``).

    Args:
        env: this process's distributed environment (the count's all-reduce).
    """

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.count: torch.Tensor | float = 0.0  # this rank's items so far in the step
        self.counted_in: Micro | None = None  # the micro-batch of the last count= backward
        self.kinds: set[str] = set()  # the step's kinds of loss: "mean", "sum", "count"

    def reset(self) -> None:
        """A step opens."""
        self.count, self.counted_in, self.kinds = 0.0, None, set()

    def add(self, loss: torch.Tensor, reduction: str, count: Any, micro: Micro, monitor: Any) -> float:
        """Log ``loss`` as what it is and return what its backward multiplies it by."""
        if reduction not in REDUCTIONS:
            raise ConfigError(
                f"run.backward(reduction={reduction!r}): use 'mean' (a mean over the micro-batch's "
                "samples), 'sum' (a sum over them) or count=N (a sum over N tokens or weights)"
            )
        self._check_kind("count" if count is not None else reduction)
        counts = micro.samples > 0  # a stand-in sample counts for nothing
        world = self.env.world_size
        if count is None and reduction == "mean":
            monitor.loss(loss, micro.samples, micro.samples)
            return micro.scale
        if count is None:  # a sum: per step, the sum over the global batch
            monitor.loss(loss, float(counts), micro.scale / world)
            return float(world * counts)
        if self.counted_in is micro:
            raise ConfigError(
                "run.backward(count=...) ran twice in one micro-batch; add the losses and their counts "
                "and call it once: run.backward(loss_a + loss_b, count=n_a + n_b)"
            )
        if not isinstance(count, torch.Tensor | int | float) or isinstance(count, bool):
            raise ConfigError(f"run.backward(count={count!r}) needs a number or a tensor: the items summed")
        count = count.detach() if isinstance(count, torch.Tensor) else float(count)
        mine = count if counts else 0.0
        self.count, self.counted_in = self.count + mine, micro
        monitor.loss(loss, float(counts), mine)
        return float(world * counts)

    def _check_kind(self, kind: str) -> None:
        # divide() acts on every gradient of the step: a loss of another kind in the same step
        # (another model's mean loss, say) would be divided by the count too.
        kinds = self.kinds | {kind}
        if "count" in kinds and len(kinds) > 1:
            other = sorted(kinds - {"count"})[0]
            raise ConfigError(
                f"run.backward(count=...) divides the whole step's gradient by the global count, so it "
                f"cannot share a step with a reduction={other!r} loss; give that loss as a sum over the "
                "same items in the one count= backward, or train the two on separate steps"
            )
        self.kinds = kinds

    def divide(self, models: Iterable[nn.Module]) -> None:
        """The step's last backward is done: its gradient, a sum over items, becomes their mean."""
        total = torch.as_tensor(self.count, dtype=torch.float64, device=self.env.collective_device)
        if self.env.world_size > 1:
            dist.all_reduce(total)  # the global batch's count: one number per step
        grads = [p.grad for m in models for p in unwrap(m).parameters() if p.grad is not None]
        if grads:
            total = total.to(grads[0].device, torch.float32)
            for grad in grads:  # DTensors (fsdp) too: the division is local to each shard
                grad.div_(total)


def check_differentiable(loss: torch.Tensor, models: dict[str, nn.Module]) -> None:
    """One line for a loss nothing trainable contributed to (every model frozen, or no_grad)."""
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return
    frozen = [
        f"{name} ({type(unwrap(m)).__name__})"
        for name, m in models.items()
        if not any(p.requires_grad for p in unwrap(m).parameters())
    ]
    why = (
        f"every parameter of {', '.join(frozen)} is frozen (requires_grad=False)"
        if frozen
        else ("it was computed under torch.no_grad() or from tensors that do not require grad")
    )
    raise ConfigError(
        f"run.backward got a loss with no gradient to compute: {why}; unfreeze before the forward "
        "whose loss trains (freezing around another model's pass, as a GAN does, is fine)"
    )
