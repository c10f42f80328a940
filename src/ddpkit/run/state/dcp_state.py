"""What of a Run's checkpoint goes through torch.distributed.checkpoint, and how it comes back.

A sharded model (``engine="fsdp"``) and every optimizer over its parameters are saved by all ranks
through DCP (``checkpoint/dcp.py``), each through torch's ``get_model_state_dict`` /
``get_optimizer_state_dict`` (parameter names as keys, DTensor shards as values) and restored with
``set_model_state_dict`` / ``set_optimizer_state_dict``; the rest of the checkpoint stays in
rank 0's state.pt. Names as keys make the DCP part loadable into the same model sharded over
another number of ranks, or unsharded (a fsdp checkpoint resumes a torch or native run too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.checkpoint.dcp import is_sharded_entry, load_sharded, saved_keys, saved_layout
from ddpkit.checkpoint.kept import KeptFiles
from ddpkit.errors import ConfigError
from ddpkit.run.engine.fsdp import is_sharded, reshard
from ddpkit.run.state.ema import EMA
from ddpkit.run.step.optim import ungated, user_class


class ModelState:
    """A module as DCP's Stateful: its state by parameter name (DTensor shards when sharded)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state)


class OptimizerState:
    """An optimizer over ``module``'s parameters as DCP's Stateful, its state keyed by their names."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        with ungated(self.optimizer):
            return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        with ungated(self.optimizer):
            set_optimizer_state_dict(self.module, self.optimizer, state)


def sharded_parts(objects: dict[str, Any], spread: bool = False) -> dict[str, Any]:
    """name -> Stateful for every sharded model and every optimizer over one's parameters; {} when
    no model is sharded (then the whole checkpoint is rank 0's state.pt, as ever). ``spread``:
    every model, full copies too, so DCP spreads the writing of their tensors over the ranks
    (its planner gives each replicated tensor to one rank: about S/N a rank)."""
    models = {
        name: obj
        for name, obj in objects.items()
        if isinstance(obj, nn.Module) and (is_sharded(obj) or spread) and not isinstance(obj, EMA)
    }
    if not models:
        return {}
    for module in models.values():
        reshard(module)  # the registered parameters are the shards again, after a forward of the user's
    parts: dict[str, Any] = {name: ModelState(module) for name, module in models.items()}
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            owner = _owner(name, obj, objects)
            if owner is not None and (is_sharded(owner) or spread):
                parts[name] = OptimizerState(owner, obj)
        elif isinstance(obj, EMA) and obj.sharded:
            parts[name] = obj  # its averages are DTensors, sharded as the model
    return parts


def _owner(name: str, optimizer: torch.optim.Optimizer, objects: dict[str, Any]) -> nn.Module | None:
    """The registered model holding all of ``optimizer``'s parameters."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for obj in objects.values():
        if isinstance(obj, nn.Module) and ids <= {id(p) for p in obj.parameters()}:
            return obj
    if any(isinstance(obj, nn.Module) and is_sharded(obj) for obj in objects.values()):
        raise ConfigError(
            f"optimizer {name!r} holds parameters of no single model set up by the run (or of several); "
            "with engine='fsdp' give each model run.setup and its own optimizer over its parameters"
        )
    return None


def load_model(
    path: str | None, name: str, saved: object, module: nn.Module, kept: KeptFiles | None = None
) -> None:
    """``run.setup``: a sharded checkpoint's weights into ``module``, once it is sharded (or not:
    DCP gives a plain model the full tensors), the files this rank hashed read from ``kept``.
    Collective; nothing when ``saved`` is not sharded."""
    if not is_sharded_entry(saved):
        return
    part = ModelState(module)
    theirs = {key.split(".", 1)[1] for key in saved_keys(path, kept) if key.startswith(f"{name}.")}
    mine = set(part.state_dict())
    if mine - theirs or (theirs - mine and not any(k.startswith("state.") for k in theirs)):
        first = sorted(mine - theirs or theirs - mine)[0]
        raise ConfigError(
            f"cannot resume {name!r} from {path}: it holds another model ({len(mine - theirs)} of this "
            f"model's tensors missing, {len(theirs - mine)} unknown; first {first!r}); resume from a "
            "checkpoint of this model, or start a new out"
        )
    load_sharded(path, {name: part}, kept)


def restore_parts(
    path: str, saved: dict[str, Any], objects: dict[str, Any], kept: KeptFiles | None = None
) -> set[str]:
    """At the loop's first batch: the DCP part of every optimizer and EMA that has one (the files this
    rank hashed read from ``kept``); returns the names of every part the DCP files hold (their
    models came back at ``run.setup``). Collective."""
    names = {name for name, value in saved.items() if is_sharded_entry(value)}
    parts: dict[str, Any] = {}
    layout: dict[str, Any] = {}
    for name, obj in objects.items():
        if isinstance(obj, EMA) and (name in names or obj.sharded):
            if name not in names:
                raise ConfigError(
                    f"cannot resume {name!r} (ddpkit.EMA) from {path}: it was saved unsharded (engine torch "
                    "or native) and this run shards its model; resume it with the engine that wrote it"
                )
            parts[name] = obj
            continue
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        owner = _owner(name, obj, objects)
        if name in names:
            parts[name] = OptimizerState(owner, obj)
            layout = layout or saved_layout(path, kept)
            template_state(name, obj, owner, layout)
        elif owner is not None and is_sharded(owner):
            raise ConfigError(
                f"cannot resume optimizer {name!r} from {path}: it was saved unsharded (engine torch or "
                "native) and this run shards its model; resume it with the engine that wrote it"
            )
    if parts:
        load_sharded(Path(path), parts, kept)
    return names


# torch's optimizers whose state is the step count and tensors shaped and sharded as each parameter.
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Adagrad",
        "Adadelta",
        "ASGD",
        "Rprop",
    )
)


def template_state(name: str, optimizer: torch.optim.Optimizer, module: nn.Module, layout: dict) -> bool:
    """Give an optimizer with no state yet the state the checkpoint holds for it, as zeros of each
    saved tensor's shape and dtype (sharded as its parameter), for DCP to load into: without it,
    torch's ``get/set_optimizer_state_dict`` make the state with an optimizer step at lr 0.

    ``layout`` is the checkpoint's metadata (flattened key -> what DCP saved there). Only when
    every saved state key of ``name`` belongs to a parameter of ``module`` by its name and every
    one is a tensor, and for torch's own optimizers whose state is elementwise (``ELEMENTWISE``:
    another's state may be shaped as a parameter and not sharded as it); otherwise nothing is set
    and torch's step at lr 0 makes the state, as before. Returns whether the state was set."""
    if optimizer.state or user_class(optimizer) not in ELEMENTWISE:
        return False
    params = {_plain_name(n): p for n, p in module.named_parameters()}
    prefix = f"{name}.state."
    state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for key, saved in layout.items():
        if not key.startswith(prefix):
            continue
        fqn, _, kind = key[len(prefix) :].rpartition(".")
        param, size = params.get(fqn), getattr(saved, "size", None)
        if param is None or size is None:
            return False  # a name this model does not have, or a value that is not a tensor
        dtype = saved.properties.dtype
        like = torch.zeros_like(param, dtype=dtype) if tuple(size) == tuple(param.shape) else None
        state.setdefault(param, {})[kind] = like if like is not None else torch.zeros(size, dtype=dtype)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not state or any(id(param) not in in_optimizer for param in state):
        return False
    optimizer.state.update(state)
    return True


def _plain_name(name: str) -> str:
    """A parameter's name as DCP's state dicts key it: without torch.compile's and activation
    checkpointing's wrapper names."""
    return ".".join(
        part for part in name.split(".") if part not in ("_orig_mod", "_checkpoint_wrapped_module")
    )


SPREAD_BYTES = 256 * 2**20  # a full-copy checkpoint from this size on goes through DCP (sharded_save=None)


def spreads(objects: dict[str, Any], world_size: int, sharded_save: bool | None, async_save: bool) -> bool:
    """Whether a full-copy run's models and optimizers are saved through DCP, each rank writing
    about S/N: as ``sharded_save`` says, or by default on 2+ ranks (without ``async_save``, which
    writes rank 0's state.pt) once models and optimizer state reach SPREAD_BYTES; below that
    DCP's planning costs more than it spreads. The same answer on every rank."""
    if sharded_save is not None:
        return sharded_save
    if world_size == 1 or async_save:
        return False
    tensors = [t for obj in objects.values() if isinstance(obj, nn.Module) for t in obj.state_dict().values()]
    for obj in objects.values():
        if isinstance(obj, torch.optim.Optimizer):
            tensors += [
                v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            ]
    return sum(t.numel() * t.element_size() for t in tensors) >= SPREAD_BYTES
