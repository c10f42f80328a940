"""Each optimizer step's gradient norm (``total_norm``), and its non-finite check without a host
sync on the step itself.

Reading a CUDA tensor's value (``norm.item()``) makes the CPU wait for the GPU, and the Python
of the next step then runs while the GPU idles. Instead each optimizer step's norm is copied to
pinned host memory without blocking and read one step later, at the next optimizer step, when
the copy has long landed (a CUDA event says so; waiting on it there costs nothing but on the
rare step the GPU runs more than a step behind), and at the latest before a log line, a
checkpoint or the run's end is written. So ``on_nonfinite="stop"`` stops every rank at the same
point, one step after the bad one or before anything is written, naming the bad step: a
non-finite update never reaches a checkpoint or ``model.pt``. On the CPU the norm is host memory
already and the same rule applies. ``on_nonfinite="skip"`` must decide before the step, so it
reads the norm at once: one sync a step, as torch's GradScaler makes.
"""

from __future__ import annotations

import math
from collections import deque

import torch
from torch import nn


class NormWatch:
    """Gradient norms of recent optimizer steps, read once they are on the host."""

    def __init__(self) -> None:
        self.pending: deque[tuple[int, torch.Tensor, torch.cuda.Event | None]] = deque()
        self._spare: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # read already: free to reuse

    def add(self, step: int, norm: torch.Tensor) -> None:
        """Queue ``step``'s gradient norm (a tensor on the device) for the check."""
        if norm.device.type == "cuda":
            # A pinned scalar and an event of a norm read before, or new ones (a pinned allocation
            # and an event cost about as much as the rest of this check).
            spare = self._spare.pop() if self._spare else None
            if spare is None or spare[0].dtype != norm.dtype:
                spare = (torch.empty((), dtype=norm.dtype, pin_memory=True), torch.cuda.Event())
            host, landed = spare
            host.copy_(norm.detach(), non_blocking=True)
            landed.record()
            self.pending.append((step, host, landed))
        else:
            self.pending.append((step, norm.detach(), None))

    def first_nonfinite(self, before: int | None = None) -> tuple[int, float] | None:
        """The first queued norm that is not finite (its step and value), reading every norm of the
        steps before ``before`` (None: all of them); the others stay queued."""
        while self.pending and (before is None or self.pending[0][0] < before):
            step, host, landed = self.pending.popleft()
            if landed is not None:
                landed.synchronize()  # long done but on the rare step the GPU is a step behind
                self._spare.append((host, landed))  # its copy landed: the next add may reuse it
            value = float(host)  # host memory: no device sync
            if not math.isfinite(value):
                self.pending.clear()
                return step, value
        return None


def total_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The gradients' global 2-norm, a plain tensor, clipping them to ``max_norm`` when it is above 0."""
    if max_norm > 0:
        norm = nn.utils.clip_grad_norm_(params, max_norm)
    else:
        grads = [p.grad for p in params]
        first = grads[0] if grads else None
        if first is not None and all(
            type(g) is torch.Tensor and g.device == first.device and g.dtype == first.dtype for g in grads
        ):
            # One foreach kernel and a norm of the norms: get_total_norm's grouping by device and
            # dtype costs 15 us a step more in Python, paid on every step for the non-finite check.
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        norm = nn.utils.get_total_norm(grads)
    # fsdp's sharded gradients give a DTensor norm. Its full tensor is the same value on every rank
    # (a no-op for a replicated one) and a plain tensor, which a pinned host copy can take.
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters that hold a gradient this step."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
