"""The engines' one-line errors: a parameter without a gradient, named in the user's model and
in ``ddpkit.Run``'s terms (torch's DDP numbers them and names its own keyword), and a
``requires_grad`` changed in the middle of a step."""

from __future__ import annotations

import re

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import ConfigError
from ddpkit.parallel.errors import DataParallelError
from ddpkit.run.engine.local import numbered

# torch's DDP raises this at the forward after a backward pass in which some parameters got no
# gradient, and numbers them (not by name unless TORCH_DISTRIBUTED_DEBUG is set).
_UNFINISHED = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def trainable_error(module: nn.Module, was: tuple[bool, ...], model: str, step: int) -> ConfigError:
    params = list(module.named_parameters())
    changed = next(name for (name, p), before in zip(params, was, strict=True) if p.requires_grad != before)
    what = f"requires_grad of {changed!r} of {model} changed in the middle of step {step}"
    return ConfigError(
        f"{what}; freeze or unfreeze between steps (after an epoch, or before the step's first "
        "forward), so every rank's gradient covers the whole step"
    )


def unused_names(exc: RuntimeError, model: nn.Module) -> list[str] | None:
    """The parameters ``exc`` says got no gradient, by name; None if it says something else."""
    if isinstance(exc, DataParallelError) and hasattr(exc, "missing"):  # the native engine's names
        return [_plain_name(name) for name in exc.missing]
    text = str(exc)
    if _UNFINISHED not in text:
        return None
    found = _INDICES.search(text)
    if found is None:
        return []
    names = _torch_param_names(model)
    return [names[int(i)] for i in found[1].split() if int(i) < len(names)]


def _torch_param_names(ddp: DistributedDataParallel) -> list[str]:
    """The names of the parameters torch's DDP numbers, in its order (``numbered``), less those
    it was told to ignore."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    return [_plain_name(name) for name, _ in numbered(ddp.module) if name not in ignored]


def _plain_name(name: str) -> str:
    """A parameter's name in the model the user built: without torch.compile's ``_orig_mod.``."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def unused_error(names: list[str], model: str) -> DataParallelError:
    listed = ", ".join(map(repr, names[:8])) + (" ..." if len(names) > 8 else "")
    which = f"{len(names)} parameter(s) of {model} ({listed})" if names else f"parameters of {model}"
    return DataParallelError(
        f"{which} got no gradient in the last backward pass; pass "
        "ddpkit.Run(find_unused_parameters=True) if the forward leaves them out, or freeze them "
        "before run.setup with requires_grad_(False) if they are never trained"
    )
