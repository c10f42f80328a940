"""The averaged weights of another library's EMA, for ``run.finish()`` to write as ``OUT/NAME.pt``.

``ddpkit.EMA`` writes its average at ``run.finish()`` (run/state/ema.py); a tracked average of another
library gets the same file, the model's state dict with the averaged weights:

- torch's ``AveragedModel`` and timm's ``ModelEmaV2``/``ModelEmaV3`` hold the average as a module
  of their own, ``.module`` (a deep copy of the model): its state dict is the file;
- diffusers' ``EMAModel`` holds a list of averaged tensors, ``shadow_params``, in the order of the
  parameters of the model it was made from: they are copied into the first model the run set up
  whose parameters have their shapes, for the write, and the model's own weights put back after.

Each is checkpointed through its own ``state_dict()`` like any tracked object; this is only the
file at the end.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ddpkit.dist import DistEnv
from ddpkit.run.engine.fsdp import reshard
from ddpkit.run.engine.wrap import unwrap

log = logging.getLogger(__name__)


def holds_module(obj: object) -> bool:
    """An average kept as a module of its own: ``AveragedModel``, timm's ``ModelEma*`` (a module
    with ``.module`` and ``update``)."""
    if isinstance(obj, AveragedModel):
        return True
    if not isinstance(obj, nn.Module):
        return False
    return isinstance(getattr(obj, "module", None), nn.Module) and callable(getattr(obj, "update", None))


def shadow_tensors(obj: object) -> list[torch.Tensor] | None:
    """diffusers' ``EMAModel``'s averaged tensors (``shadow_params``), None for anything else."""
    shadow = getattr(obj, "shadow_params", None)
    if isinstance(shadow, list) and callable(getattr(obj, "copy_to", None)):
        return shadow
    return None


@contextlib.contextmanager
def library_average(obj: object, models: dict[str, nn.Module], env: DistEnv) -> Iterator[nn.Module | None]:
    """The bare module holding ``obj``'s averaged weights inside the block; None when ``obj`` is no
    average (or an ``EMAModel`` of no model the run set up: rank 0 says so)."""
    if holds_module(obj):
        yield unwrap(obj.module)  # made from the wrapped model, it holds a copy of the wrapper
        return
    shadow = shadow_tensors(obj)
    if shadow is None:
        yield None
        return
    module = _model_of(shadow, models)
    if module is None:
        if env.is_rank0:
            log.warning(
                "a tracked %s averages %d tensors that match no model of run.setup in shape; its "
                "OUT file is not written: copy its average into a model (ema.copy_to(...)) and save that",
                type(obj).__name__,
                len(shadow),
            )
        yield None
        return
    with _swapped(module, shadow):
        yield module


def _model_of(shadow: list[torch.Tensor], models: dict[str, nn.Module]) -> nn.Module | None:
    """The first bare model whose parameters have the shapes of ``shadow``, in order."""
    shapes = [t.shape for t in shadow]
    for model in models.values():
        module = unwrap(model)
        if [p.shape for p in module.parameters()] == shapes:
            return module
    return None


@contextlib.contextmanager
def _swapped(module: nn.Module, values: list[torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters hold ``values`` inside the block, and their own again after, exactly."""
    reshard(module)
    params = list(module.parameters())
    with torch.no_grad():
        kept = [p.detach().clone() for p in params]
        for param, value in zip(params, values, strict=True):
            param.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            reshard(module)
            for param, value in zip(params, kept, strict=True):
                param.copy_(value)
