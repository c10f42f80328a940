"""A step's earlier micro-batches' gradients, set aside while the user's loop runs."""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.run.engine import unwrap


class HeldGrads:
    """The gradients of a step's earlier micro-batches, held aside while the user's loop runs.

    ``hold`` after a backward that does not end the step, ``restore`` before the next backward:
    autograd then adds to them as without holding (the same tensors, so an engine's gradient
    views stay its own), and in between every ``p.grad`` of the run's models is None. A gradient
    edit in that gap (a clip_grad_norm_ written for one batch a step) then changes nothing; at the
    step's last micro-batch it sees the whole step's all-reduced gradient, as without micro_batch.
    """

    def __init__(self, models: dict[str, nn.Module]) -> None:
        self.models = models
        self.held: list[tuple[nn.Parameter, torch.Tensor]] = []

    def hold(self) -> None:
        for model in self.models.values():
            for param in unwrap(model).parameters():
                if param.grad is not None:
                    self.held.append((param, param.grad))
                    param.grad = None

    def restore(self) -> None:
        if not self.held:
            return
        held, self.held = self.held, []
        for param, grad in held:
            # A gradient made meanwhile outside run.backward is kept, and added to.
            param.grad = grad if param.grad is None else param.grad.add_(grad)
