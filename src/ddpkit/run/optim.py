"""Gradient accumulation for the user's own optimizers and LR schedulers, without changing their loop.

A single-device loop calls ``zero_grad``, ``backward`` and ``step`` once per batch. Under
``ddpkit.Run`` a batch is a micro-batch, and several make one optimizer step. ``run.track``
gives the user's optimizer and scheduler objects (the same objects, so every reference the user
holds is affected) a subclass whose ``step`` only acts on a step's last micro-batch and whose
``zero_grad`` only acts at a step boundary; on that last micro-batch, ``step`` first checks the
gradient norm (identical on every rank, since gradients are all-reduced) and clips it if asked.
Lightning Fabric swaps ``__class__`` the same way; Accelerate wraps the optimizer instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddpkit.errors import ConfigError

if TYPE_CHECKING:
    from ddpkit.run.steps import StepCycle

NONFINITE = ("stop", "skip")


@dataclass(frozen=True)
class OptimConfig:
    """What happens in the optimizer step that ddpkit sees.

    Args:
        grad_clip: clip each optimizer's gradient norm to this; 0 disables clipping.
        on_nonfinite: a non-finite gradient norm ``stop``s the run on every rank, or ``skip``s
            that optimizer step (its gradients are dropped).
    """

    grad_clip: float = 0.0
    on_nonfinite: str = "stop"

    def __post_init__(self) -> None:
        if not 0 <= self.grad_clip < float("inf"):
            raise ConfigError(f"grad_clip={self.grad_clip} must be finite and >= 0; use 0 to disable, or 1.0")
        if self.on_nonfinite not in NONFINITE:
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r} must be 'stop' or 'skip'")


class _GatedOptimizer:
    """Mixed in before the user's optimizer class by ``gate``."""

    _ddpkit_cycle: StepCycle

    def step(self, closure: Callable | None = None) -> Any:
        cycle = self._ddpkit_cycle
        if cycle.accumulating:
            return None  # not the step's last micro-batch: keep accumulating
        if getattr(self, "_ddpkit_inner", False):  # the GradScaler calling back in
            return super().step(closure)
        self._opt_called = True  # what torch's LR schedulers check before warning
        self._ddpkit_stepped = True
        return cycle.optimizer_step(self, super().step, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Clear only at a step boundary: before the step's first backward, or once this
        # optimizer has stepped. In between, the micro-batches' gradients are accumulating.
        if self._ddpkit_cycle.has_backward and not getattr(self, "_ddpkit_stepped", False):
            return
        self._ddpkit_stepped = False
        super().zero_grad(set_to_none)

    def __reduce_ex__(self, protocol: int) -> Any:
        # Pickles as the user's own class: the run is not part of the optimizer.
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_ddpkit")}
        return _rebuild, (_user_class(self), state)


# An LR scheduler patches optimizer.step to notice calls unless the step is marked as patched.
_GatedOptimizer.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


class _GatedScheduler:
    """Mixed in before the user's LR scheduler class by ``gate``."""

    _ddpkit_cycle: StepCycle

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._ddpkit_cycle.accumulating:
            return None
        return super().step(*args, **kwargs)

    def state_dict(self) -> dict:
        # A scheduler's state_dict is its __dict__, which now also holds the run.
        return {k: v for k, v in super().state_dict().items() if not k.startswith("_ddpkit")}

    def __reduce_ex__(self, protocol: int) -> Any:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_ddpkit")}
        return _rebuild, (_user_class(self), state)


def _user_class(obj: object) -> type:
    return type(obj).__mro__[2]  # (the gated class, the mixin, the user's class, ...)


def _rebuild(cls: type, state: dict) -> object:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


_CLASSES: dict[type, type] = {}


def gate(obj: object, cycle: StepCycle) -> None:
    """Make an optimizer or LR scheduler step only at step boundaries; other objects are left alone."""
    if isinstance(obj, torch.optim.Optimizer):
        mixin = _GatedOptimizer
        # A scheduler built before this call replaced obj.step on the instance; drop that so
        # the class's gated step is what runs (it keeps the scheduler's bookkeeping itself).
        obj.__dict__.pop("step", None)
    elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
        mixin = _GatedScheduler
    else:
        return
    if isinstance(obj, mixin):
        raise ConfigError(f"this {type(obj).__mro__[2].__name__} is already tracked by a run; track it once")
    cls = type(obj)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__})
    obj.__class__ = _CLASSES[cls]
    obj._ddpkit_cycle = cycle


def total_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The gradients' global 2-norm, clipping them to ``max_norm`` when it is above 0."""
    if max_norm > 0:
        return nn.utils.clip_grad_norm_(params, max_norm)
    return nn.utils.get_total_norm([p.grad for p in params])


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters that hold a gradient this step."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
