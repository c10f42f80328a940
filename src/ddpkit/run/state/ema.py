"""``ddpkit.EMA``: an exponential moving average of a model's weights, on every engine, fsdp too.

torch's ``AveragedModel`` deep-copies the model, which FSDP2 refuses, and a copy of a full model
is what sharding exists to avoid. ``EMA`` instead keeps one averaged tensor per parameter beside
it, shaped as the parameter is: a full tensor on the full-copy engines, on fsdp a DTensor of the
same sharding, so each rank averages and stores only its own shards, and a checkpoint saves them
through DCP like the model (any number of processes on resume, 2 -> 3 included). The average
is AveragedModel's with ``get_ema_multi_avg_fn(decay)``: the first update copies the weights,
each later one moves the average ``1 - decay`` of the way to them (one foreach lerp). ``decay``
may be a function of the run's optimizer step instead, a warm-up (``ema_warmup``): the step is
the run's, checkpointed with it, so a resumed run continues the warm-up where it stopped.

Use it as::

    model = run.setup(Net(), optimizer)
    ema = ddpkit.EMA(model, decay=0.999)
    run.track(ema=ema)                      # checkpointed; OUT/ema.pt at run.finish()
    ...
        optimizer.step()
        ema.update()                        # once per optimizer step (micro-batches wait)
    with ema.applied():                     # the model holds the average inside
        val = run.evaluate(held_out, fn)

``OUT/ema.pt`` (``OUT/NAME.pt`` for ``run.track(NAME=ema)``) is the model's state dict with the
averaged weights and the model's own buffers, loadable into a fresh model as ``model.pt`` is;
the averages of other libraries (diffusers' ``EMAModel``, timm's ``ModelEmaV3``, torch's
``AveragedModel``) get the same file (run/state/averages.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.engine.fsdp import is_sharded, reshard
from ddpkit.run.engine.models import save_weights
from ddpkit.run.engine.wrap import unwrap
from ddpkit.run.state.averages import library_average
from ddpkit.run.step_state import StepState


def is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "placements")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view: writes reach the parameter), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _is_decay(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0.0 <= value < 1.0


def _is_positive(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0


class EMA:
    """An exponential moving average of ``model``'s parameters, sharded as they are.

    Args:
        model: the model ``run.setup`` returned (or its bare module).
        decay: how much of the average each update keeps, in [0, 1): 0.999 averages over about
            the last 1000 steps. Or a function of the optimizer step the update follows
            (``run.step``: 1 at the first) that gives it, a warm-up: ``ddpkit.ema_warmup(...)``.
    """

    def __init__(self, model: nn.Module, decay: float | Callable[[int], float] = 0.999) -> None:
        if not (callable(decay) or _is_decay(decay)):
            raise ConfigError(
                f"ddpkit.EMA(decay={decay!r}): give a number in [0, 1), e.g. 0.999, or a function of "
                "the step such as ddpkit.ema_warmup()"
            )
        self.module, self.updates = unwrap(model), 0
        self.decay = decay if callable(decay) else float(decay)
        reshard(self.module)
        with torch.no_grad():
            self.shadow = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        self.step_state: StepState | None = None  # run.track hands it the run's step state

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(averages, parameters), each rank's local parts, with the shards registered."""
        reshard(self.module)  # after a forward without backward the gathered copies are registered
        params = dict(self.module.named_parameters())
        first = next(iter(self.shadow), None)
        if params.keys() != self.shadow.keys() or (
            first is not None
            and (is_dtensor(params[first]), params[first].device)
            != (is_dtensor(self.shadow[first]), self.shadow[first].device)
        ):
            raise ConfigError(
                "ddpkit.EMA: the model was placed or sharded after the EMA was made from it; make the EMA "
                "after run.setup, from the model it returned"
            )
        return [_local(t) for t in self.shadow.values()], [_local(params[n].detach()) for n in self.shadow]

    @torch.no_grad()
    def update(self) -> None:
        """Average the model's current weights in: call it after ``optimizer.step()``. On a step's
        earlier micro-batches (the optimizer has not stepped yet) it does nothing."""
        if self.step_state is None:
            raise ConfigError(
                "ddpkit.EMA.update() before run.track(ema=ema): tracked, the average is checkpointed (a "
                "resume would otherwise start it again from the current weights) and waits for a step's "
                "last micro-batch; call run.track(ema=ema) before the loop"
            )
        if self.step_state.accumulating:
            return
        averages, params = self._pairs()
        if self.updates == 0:
            torch._foreach_copy_(averages, params)
        else:
            torch._foreach_lerp_(averages, params, 1.0 - self._decay_at(self.step_state.step))
        self.updates += 1

    def _decay_at(self, step: int) -> float:
        """The decay of the update at optimizer step ``step``: the number, or the function's value."""
        if not callable(self.decay):
            return self.decay
        value = self.decay(step)
        if not _is_decay(value):
            raise ConfigError(
                f"ddpkit.EMA: its decay function gave {value!r} at step {step}; it must give a number in "
                "[0, 1) at every step (ddpkit.ema_warmup clamps to max_decay)"
            )
        return float(value)

    @contextlib.contextmanager
    def applied(self) -> Iterator[nn.Module]:
        """The model holds the averaged weights inside the block (evaluate, save) and its own
        again after it, exactly; yields the bare model."""
        with torch.no_grad():
            averages, params = self._pairs()
            kept = [p.clone() for p in params]
            torch._foreach_copy_(params, averages)
        try:
            yield self.module
        finally:
            with torch.no_grad():
                reshard(self.module)  # a forward inside left the average's gathered copies
                torch._foreach_copy_(params, kept)

    def state_dict(self) -> dict[str, Any]:
        # A decay function is the script's, not the checkpoint's: the step it reads is the run's.
        decay = None if callable(self.decay) else self.decay
        return {"decay": decay, "updates": self.updates, "shadow": dict(self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["shadow"]
        if saved.keys() != self.shadow.keys():
            missing = sorted(self.shadow.keys() ^ saved.keys())[0]
            raise ConfigError(
                f"cannot restore ddpkit.EMA: the checkpoint averages other parameters (first {missing!r}); "
                "resume with the same model"
            )
        for name, value in saved.items():
            if value is not self.shadow[name]:  # DCP loads in place; a state.pt's are copied in
                _local(self.shadow[name]).copy_(_local(value))
        self.updates = int(state["updates"])

    @property
    def sharded(self) -> bool:
        """Its averages are DTensors, saved through DCP with the model's shards."""
        return is_sharded(self.module)


def ema_warmup(
    inv_gamma: float = 1.0,
    power: float = 2 / 3,
    min_decay: float = 0.0,
    max_decay: float = 0.9999,
    update_after_step: int = 0,
) -> Callable[[int], float]:
    """The decay warm-up of diffusers' ``EMAModel(use_ema_warmup=True)`` and timm's
    ``ModelEmaV3(use_warmup=True)``, for ``ddpkit.EMA(model, decay=ddpkit.ema_warmup())``.

    At optimizer step ``step`` with ``s = step - update_after_step - 1``: 0 while ``s <= 0`` (the
    average takes the weights as they are), then ``1 - (1 + s / inv_gamma) ** -power`` clamped to
    ``[min_decay, max_decay]``. inv_gamma=1, power=2/3 reaches 0.999 near step 31.6K; power=3/4
    near step 10K.

    Args:
        inv_gamma: the warm-up's time scale, in steps (above 0).
        power: how fast the decay approaches 1 (above 0).
        min_decay: the least decay once ``s > 0``.
        max_decay: the largest decay, below 1 (diffusers' and timm's ``decay``).
        update_after_step: steps before the warm-up starts.
    """
    if not (_is_positive(inv_gamma) and _is_positive(power)):
        raise ConfigError(
            f"ddpkit.ema_warmup(inv_gamma={inv_gamma!r}, power={power!r}): both must be above 0, "
            "e.g. inv_gamma=1.0, power=2/3"
        )
    if not (_is_decay(min_decay) and _is_decay(max_decay) and min_decay <= max_decay):
        raise ConfigError(
            f"ddpkit.ema_warmup(min_decay={min_decay!r}, max_decay={max_decay!r}): give "
            "0 <= min_decay <= max_decay < 1, e.g. max_decay=0.9999"
        )
    if isinstance(update_after_step, bool) or not isinstance(update_after_step, int) or update_after_step < 0:
        raise ConfigError(
            f"ddpkit.ema_warmup(update_after_step={update_after_step!r}): give a whole number of steps >= 0"
        )
    return functools.partial(
        _warmup_decay,
        inv_gamma=float(inv_gamma),
        power=float(power),
        bounds=(float(min_decay), float(max_decay)),
        after=update_after_step,
    )


def _warmup_decay(
    step: int, inv_gamma: float, power: float, bounds: tuple[float, float], after: int
) -> float:
    s = max(0, step - after - 1)
    if s <= 0:
        return 0.0
    return max(min(1 - (1 + s / inv_gamma) ** -power, bounds[1]), bounds[0])


def save_final(models: dict[str, nn.Module], objects: dict[str, Any], out: Path | None, env: DistEnv) -> None:
    """At ``run.finish()``: ``OUT/NAME.pt`` for every model, then for every tracked average (a
    ``ddpkit.EMA``, or another library's: run/state/averages.py) the model's state dict with the averaged
    weights. All ranks call it: on fsdp each is gathered from the shards."""
    if out is None:
        return
    for name, model in models.items():
        save_weights(unwrap(model), out / f"{name}.pt", env)
    for name, obj in objects.items():
        if name in models:
            continue
        average = obj.applied() if isinstance(obj, EMA) else library_average(obj, models, env)
        with average as module:
            if module is not None:
                save_weights(module, out / f"{name}.pt", env)
