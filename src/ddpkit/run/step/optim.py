"""Gradient accumulation for the user's own optimizers and LR schedulers, without changing their loop.

A single-device loop calls ``zero_grad``, ``backward`` and ``step`` once per batch. Under
``ddpkit.Run`` a batch is a micro-batch, and several make one optimizer step. ``run.track``
gives the user's optimizer and scheduler objects (the same objects, so every reference the user
holds is affected) a subclass whose ``step`` only acts on a step's last micro-batch and whose
``zero_grad`` only acts at a step boundary; on that last micro-batch, ``step`` first checks the
gradient norm (identical on every rank, since gradients are all-reduced) and clips it if asked.
Lightning Fabric and Accelerate leave the user's optimizer's class alone and hand back a wrapper
instead (Fabric's ``_FabricOptimizer`` gives the wrapper, not the optimizer, a ``__class__`` that
subclasses the optimizer's, so ``isinstance`` checks pass).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.run.config import OptimConfig
from ddpkit.run.state.averages import holds_module, shadow_tensors
from ddpkit.run.state.ema import EMA
from ddpkit.run.step.held_grads import HeldGrads
from ddpkit.run.step.norms import NormWatch, optimizer_params, total_norm
from ddpkit.run.step_state import StepState

log = logging.getLogger(__name__)


class OptimizerGate:
    """What the gated optimizers, schedulers and EMAs of one run read, and the policy of a real step.

    They read the run's step state (``state.accumulating``: a step's micro-batch before its last,
    so ``step()`` waits; ``state.has_backward``: a backward ran in the open step, so
    ``zero_grad()`` keeps the gradients), which the step cycle alone writes. What they do, the
    gate records with the step it happened at, for the cycle to read. A gated optimizer's real
    step comes here: unscale (fp16), clip, and stop or skip on a non-finite norm.

    Args:
        cfg: clipping and non-finite gradients.
        scaler: the fp16 GradScaler (disabled otherwise).
        state: the run's step state.
        held: the step's held gradients (run/step/held_grads.py): gated steps and zero_grads tell it.
    """

    def __init__(
        self, cfg: OptimConfig, scaler: torch.amp.GradScaler, state: StepState, held: HeldGrads
    ) -> None:
        self.cfg, self.scaler, self.state, self.held = cfg, scaler, state, held
        self.skipped_steps = 0
        self.last_lr: float | None = None  # the first optimizer's rate at its last real step
        self.lr_optimizer: torch.optim.Optimizer | None = None  # the first tracked optimizer
        self.norms = NormWatch()  # on_nonfinite="stop": each step's norm, read a step later
        self.inner = False  # the GradScaler (or DCP) calling a gated optimizer's own step
        # Before a real step or an average's update changes what a checkpoint's background copy
        # is reading (async_save): wait for that copy (BackgroundWriter.wait_staged).
        self.before_update: Callable[[], None] = lambda: None
        self._stepped_at = -1  # the step a tracked optimizer last really stepped in
        self._waited_at = (-1, -1)  # (step, micro-batch) a tracked optimizer's step last waited in
        self._stepped: set[int] = set()  # ids of the optimizers stepped since their zero_grad

    @property
    def stepped(self) -> bool:
        """A tracked optimizer stepped in the open (or last) step."""
        return self._stepped_at == self.state.step

    @property
    def waited(self) -> bool:
        """A tracked optimizer's step waited in this micro-batch (its weights are a step behind)."""
        return self._waited_at == (self.state.step, self.state.micro_batches)

    def wait(self) -> None:
        """A tracked optimizer's step came before the step's last micro-batch, and waits."""
        self._waited_at = (self.state.step, self.state.micro_batches)

    def keeps_grads(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer.zero_grad()`` must keep the gradients: a backward ran in the open
        step and this optimizer has not stepped since its last zero_grad."""
        return self.state.has_backward and id(optimizer) not in self._stepped

    def zeroed(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.zero_grad()`` cleared its gradients: its next step starts afresh."""
        self._stepped.discard(id(optimizer))

    def track(self, obj: object) -> None:
        """Gate an optimizer, LR scheduler or EMA (other objects are left alone); the first
        optimizer's rate is the one metrics lines show."""
        gate(obj, self)
        if isinstance(obj, EMA):
            obj.step_state = self.state  # it reads whether the step is accumulating, and its number
        if self.lr_optimizer is None and isinstance(obj, torch.optim.Optimizer):
            self.lr_optimizer = obj

    def check_stepped(self, step: int, cut: Any = None) -> None:
        """At a step's end: a backward without any tracked optimizer's step is a loop's own
        accumulation, refused at its first step unless ``allow_unstepped``; a loop that left in
        the middle of a step (``cut``: the micro-batch it left at) is told that instead."""
        if self.state.has_backward and not self.stepped and self.lr_optimizer is not None:
            if cut is not None:
                raise ConfigError(
                    f"the loop left run.loader's loop in the middle of step {step} (a break after a "
                    "micro-batch that is not the step's last), so the step never reached optimizer.step(); "
                    "break at a step's end (if run.at_step_end: break), or set ddpkit.Run(steps=N)"
                )
            if not self.cfg.allow_unstepped:
                raise ConfigError(
                    f"step {step} ended without optimizer.step(): ddpkit.Run accumulates a step's "
                    "micro-batches itself; delete the loop's own accumulation (loss / k, a step every k "
                    "batches) and set global_batch= (samples per step) and micro_batch= (per backward), "
                    "or pass allow_unstepped=True if the loop skips steps on purpose"
                )

    def check_norms(self, before: int | None = None) -> None:
        """Stop on the first non-finite gradient norm of the steps before ``before`` (None: every
        step so far: before a log line, a checkpoint or the run's end is written)."""
        if (bad := self.norms.first_nonfinite(before)) is not None:
            step, value = bad
            raise FloatingPointError(
                f"step {step}: the gradient norm is {value} on every rank; lower the learning "
                "rate or check the data, or pass on_nonfinite='skip' to skip such steps"
            )

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable, closure: Any) -> Any:
        """A gated optimizer's real step: unscale, clip, and stop or skip on a non-finite norm."""
        self.before_update()
        step_number = self.state.step
        self._stepped_at = step_number
        self._stepped.add(id(optimizer))
        if self.last_lr is None or optimizer is self.lr_optimizer:
            self.last_lr = optimizer.param_groups[0]["lr"]
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)  # clip and check the true gradient
        norm = total_norm(optimizer_params(optimizer), self.cfg.grad_clip)
        if self.scaler.is_enabled():  # the GradScaler skips non-finite steps itself
            with ungated(optimizer):
                return self.scaler.step(optimizer)
        # The norm is of the all-reduced gradient, the same on every rank: all decide alike.
        if self.cfg.on_nonfinite == "stop":  # read a step later, never waited for here (norms.py)
            self.check_norms(before=step_number)
            self.norms.add(step_number, norm)
            return step(closure)
        # Skipping decides before the step: one .item(), the host sync torch's GradScaler makes too.
        value = norm.item()
        if math.isfinite(value):
            return step(closure)
        self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        log.warning("step %d: gradient norm is %s; optimizer step skipped", step_number, value)
        return None


class _GatedOptimizer:
    """Mixed in before the user's optimizer class by ``gate``."""

    ddpkit_gate: OptimizerGate

    def step(self, closure: Callable | None = None) -> Any:
        gate = self.ddpkit_gate
        if gate.inner:  # the GradScaler (or DCP) calling back in
            return super().step(closure)
        if gate.state.accumulating:  # not the step's last micro-batch: keep accumulating
            gate.held.close(_params(self))  # what reaches its parameters now is after its step
            gate.wait()
            return None
        self._opt_called = True  # what torch's LR schedulers check before warning
        return gate.optimizer_step(self, super().step, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Clear only at a step boundary: before the step's first backward, or once this
        # optimizer has stepped. In between, the micro-batches' gradients are accumulating.
        gate = self.ddpkit_gate
        if gate.keeps_grads(self):
            gate.held.reopen(_params(self))  # drops what came after its last step
            return
        gate.zeroed(self)
        super().zero_grad(set_to_none)

    def __reduce_ex__(self, protocol: int) -> Any:
        # Pickles as the user's own class: the run is not part of the optimizer.
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("ddpkit_")}
        return _rebuild, (user_class(self), state)


# An LR scheduler patches optimizer.step to notice calls unless the step is marked as patched.
_GatedOptimizer.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
# torch wraps an optimizer class's step with its step hooks at every load_state_dict (its
# __setstate__): marked as wrapped, the gate's step is not, so the user's hooks run once a step,
# in the optimizer's own step, and not at the micro-batches the gate holds back (torch 2.4-2.13).
_GatedOptimizer.step.hooked = True  # type: ignore[attr-defined]


class _GatedScheduler:
    """Mixed in before the user's LR scheduler class by ``gate``."""

    ddpkit_gate: OptimizerGate

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.ddpkit_gate.state.accumulating:
            return None
        return super().step(*args, **kwargs)

    def state_dict(self) -> dict:
        # A scheduler's state_dict is its __dict__, which now also holds the run.
        return {k: v for k, v in super().state_dict().items() if not k.startswith("ddpkit_")}

    def __reduce_ex__(self, protocol: int) -> Any:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("ddpkit_")}
        return _rebuild, (user_class(self), state)


def _at_step_end(name: str) -> Callable:
    """The average's own ``name`` method, run at a step's last micro-batch only."""

    def method(self, *args: Any, **kwargs: Any) -> Any:
        if self.ddpkit_gate.state.accumulating:
            return None  # not the step's last micro-batch: the weights have not moved
        self.ddpkit_gate.before_update()
        return getattr(super(_GatedAverage, self), name)(*args, **kwargs)

    return method


class _GatedAverage:
    """Mixed in before the user's average by ``gate``: torch's ``AveragedModel`` (an EMA, SWA;
    ``update_parameters``), diffusers' ``EMAModel`` (``step``) or timm's ``ModelEma*``
    (``update``) takes the weights once per optimizer step, not once per micro-batch, so its
    warm-up counts optimizer steps whether or not the loop updates it under ``run.at_step_end``."""

    ddpkit_gate: OptimizerGate
    update_parameters = _at_step_end("update_parameters")
    step = _at_step_end("step")
    update = _at_step_end("update")

    def __reduce_ex__(self, protocol: int) -> Any:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("ddpkit_")}
        return _rebuild, (user_class(self), state)


def _params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def user_class(obj: object) -> type:
    """The class the user made ``obj`` of, whether or not ``gate`` mixed its gate in."""
    gated = isinstance(obj, _GatedOptimizer | _GatedScheduler | _GatedAverage)
    return type(obj).__mro__[2] if gated else type(obj)  # (the gated class, the mixin, the user's class, ...)


def _rebuild(cls: type, state: dict) -> object:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


_CLASSES: dict[type, type] = {}


def gate(obj: object, owner: OptimizerGate) -> None:
    """Make an optimizer, LR scheduler or average (AveragedModel, EMAModel, ModelEma) act only at a
    step's last micro-batch; other objects are left alone."""
    if isinstance(obj, torch.optim.Optimizer):
        mixin = _GatedOptimizer
        # A scheduler built before this call replaced obj.step on the instance; drop that so
        # the class's gated step is what runs (it keeps the scheduler's bookkeeping itself).
        obj.__dict__.pop("step", None)
    elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
        mixin = _GatedScheduler
    elif isinstance(obj, torch.optim.swa_utils.AveragedModel) or holds_module(obj) or shadow_tensors(obj):
        mixin = _GatedAverage
    else:
        return
    if isinstance(obj, mixin):
        raise ConfigError(f"this {type(obj).__mro__[2].__name__} is already tracked by a run; track it once")
    cls = type(obj)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__})
    obj.__class__ = _CLASSES[cls]
    obj.ddpkit_gate = owner


@contextlib.contextmanager
def ungated(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Calls of a tracked optimizer's ``step`` inside run its own step as is, past the gate: the
    GradScaler's after it unscaled, or the one at lr 0 by which torch initializes an optimizer
    without state before loading a sharded state into it (neither is the run's step)."""
    gate = getattr(optimizer, "ddpkit_gate", None)
    if gate is None:  # not tracked: its step is its own already
        yield
        return
    gate.inner = True
    try:
        yield
    finally:
        gate.inner = False
