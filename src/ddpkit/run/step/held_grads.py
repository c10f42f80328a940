"""A step's earlier micro-batches' gradients, set aside while the user's loop runs."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ddpkit.run.engine.wrap import unwrap


class HeldGrads:
    """The gradients of a step's earlier micro-batches, held aside while the user's loop runs.

    ``hold`` after a backward that does not end the step, ``restore`` before the next backward:
    autograd then adds to them as without holding (the same tensors, so an engine's gradient
    views stay its own), and in between every ``p.grad`` of the run's models is None but for one
    zero placeholder per model (``clip_grad_value_`` refuses a list without any gradient). A
    gradient edit in that gap (a clip written for one batch a step) then changes nothing; at the
    step's last micro-batch it sees the whole step's all-reduced gradient, as without micro_batch.

    An optimizer's gated step in an earlier micro-batch *closes* its parameters: what backwards
    add to them afterwards is kept apart (``post``) until the loop either calls that optimizer's
    ``zero_grad()``, which drops it, as a single-device loop's zero_grad would (a GAN's generator
    loss reaching the discriminator after the discriminator stepped), or steps it again without
    one, which adds it in, as a single-device loop would accumulate it.
    """

    def __init__(self, models: dict[str, nn.Module]) -> None:
        self.models = models
        self.held: dict[nn.Parameter, torch.Tensor] = {}
        self.post: dict[nn.Parameter, torch.Tensor] = {}  # added after the parameter's step
        self.closed: set[nn.Parameter] = set()
        self.placeholders: list[tuple[nn.Parameter, torch.Tensor]] = []

    def hold(self) -> None:
        """A backward before the step's last is done: set its gradients aside."""
        for model in self.models.values():
            smallest: nn.Parameter | None = None
            for param in unwrap(model).parameters():
                if param.grad is not None:
                    store = self.post if param in self.closed else self.held
                    store[param] = _add(store.get(param), param.grad)
                    param.grad = None
                if param.requires_grad and (smallest is None or param.numel() < smallest.numel()):
                    smallest = param
            if smallest is not None:
                zeros = torch.zeros_like(smallest)
                smallest.grad = zeros
                self.placeholders.append((smallest, zeros))

    def restore(self, last: bool = True) -> None:
        """Before a backward (``last``: the step's last micro-batch, or the step's end): give the
        held gradients back to add to. Before an earlier one, a closed parameter's stay apart."""
        if not (self.placeholders or self.held or self.post or self.closed):
            return  # nothing held: a step of one micro-batch
        for param, zeros in self.placeholders:
            if param.grad is zeros:
                param.grad = None
        self.placeholders = []
        if last:
            for param, grad in self.post.items():
                self.held[param] = _add(self.held.get(param), grad)
            self.post, self.closed = {}, set()
        for param in [p for p in self.held if last or p not in self.closed]:
            # A gradient made meanwhile outside run.backward is kept, and added to.
            param.grad = _add(param.grad, self.held.pop(param))

    def close(self, params: Iterable[nn.Parameter]) -> None:
        """An optimizer stepped in an earlier micro-batch (its real step waits for the last)."""
        for param in params:
            if param in self.post:  # no zero_grad since its last step: a single device accumulates
                self.held[param] = _add(self.held.get(param), self.post.pop(param))
            self.closed.add(param)

    def reopen(self, params: Iterable[nn.Parameter]) -> None:
        """The optimizer's ``zero_grad()`` inside a step: drop what came after its last step."""
        for param in params:
            self.post.pop(param, None)
            self.closed.discard(param)


def _add(into: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    return grad if into is None else into.add_(grad)
