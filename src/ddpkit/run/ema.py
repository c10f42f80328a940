"""``ddpkit.EMA``: an exponential moving average of a model's weights, on every engine, fsdp too.

torch's ``AveragedModel`` deep-copies the model, which FSDP2 refuses, and a copy of a full model
is what sharding exists to avoid. ``EMA`` instead keeps one averaged tensor per parameter beside
it, shaped as the parameter is: a full tensor on the full-copy engines, on fsdp a DTensor of the
same sharding, so each rank averages and stores only its own shards, and a checkpoint saves them
through DCP like the model (any number of processes on resume, 2 -> 3 included). The average
is AveragedModel's with ``get_ema_multi_avg_fn(decay)``: the first update copies the weights,
each later one moves the average ``1 - decay`` of the way to them (one foreach lerp).

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
averaged weights and the model's own buffers, loadable into a fresh model as ``model.pt`` is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.engine import unwrap
from ddpkit.run.models import save_weights
from ddpkit.run.sharded import is_sharded, reshard


def is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "placements")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view: writes reach the parameter), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


class EMA:
    """An exponential moving average of ``model``'s parameters, sharded as they are.

    Args:
        model: the model ``run.setup`` returned (or its bare module).
        decay: how much of the average each update keeps, in [0, 1): 0.999 averages over about
            the last 1000 steps.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0.0 <= decay < 1.0:
            raise ConfigError(f"ddpkit.EMA(decay={decay!r}): give a number in [0, 1), e.g. 0.999")
        self.module, self.decay, self.updates = unwrap(model), float(decay), 0
        reshard(self.module)
        with torch.no_grad():
            self.shadow = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        self.accumulating: Callable[[], bool] | None = None  # run.track hands it the gate's

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
        if self.accumulating is None:
            raise ConfigError(
                "ddpkit.EMA.update() before run.track(ema=ema): tracked, the average is checkpointed (a "
                "resume would otherwise start it again from the current weights) and waits for a step's "
                "last micro-batch; call run.track(ema=ema) before the loop"
            )
        if self.accumulating():
            return
        averages, params = self._pairs()
        if self.updates == 0:
            torch._foreach_copy_(averages, params)
        else:
            torch._foreach_lerp_(averages, params, 1.0 - self.decay)
        self.updates += 1

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
        return {"decay": self.decay, "updates": self.updates, "shadow": dict(self.shadow)}

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


def save_final(models: dict[str, nn.Module], objects: dict[str, Any], out: Path | None, env: DistEnv) -> None:
    """At ``run.finish()``: ``OUT/NAME.pt`` for every model, then for every tracked EMA the model's
    state dict with the averaged weights. All ranks call it: on fsdp each is gathered from the shards."""
    if out is None:
        return
    for name, model in models.items():
        save_weights(unwrap(model), out / f"{name}.pt", env)
    for name, ema in objects.items():
        if isinstance(ema, EMA):
            with ema.applied() as module:
                save_weights(module, out / f"{name}.pt", env)
