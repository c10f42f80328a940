"""The user's model at ``run.setup`` and ``run.finish``: the same on every rank, weights in and out."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch import nn

from ddpkit.checkpoint.dcp import is_sharded_entry
from ddpkit.checkpoint.files import save_state_dict_atomic
from ddpkit.diagnostics import check_replicas_agree
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.engine.fsdp import is_sharded


def check_same_model(model: nn.Module, env: DistEnv) -> None:
    """Refuse, on every rank, a model whose parameters differ between ranks (shapes, then values)."""
    if env.world_size == 1:
        return
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    everyone: list[list | None] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            diff = next((a, b) for a, b in zip([*everyone[0], None], [*theirs, None], strict=False) if a != b)
            raise ConfigError(
                f"run.setup: rank {rank}'s model differs from rank 0's at parameter {diff[1]} "
                f"(rank 0 has {diff[0]}); build the same model on every rank"
            )
    try:
        check_replicas_agree(model, env, "at run.setup")
    except RuntimeError as exc:
        raise ConfigError(
            f"{exc}. ddpkit.Run seeds every rank alike before you build the model: do not seed per rank "
            "or load per-rank weights before run.setup"
        ) from None


def load_weights(model: nn.Module, weights: dict, name: str, path: str | None) -> None:
    """The checkpoint's weights into ``model``, or one line saying it holds another model. A
    sharded checkpoint's come once the model is sharded (``dcp_state.load_model``)."""
    if is_sharded_entry(weights):
        return
    if (mismatch := key_mismatch(model, weights)) is not None:
        raise ConfigError(
            f"cannot resume {name!r} from {path}: it holds another model ({mismatch}); "
            "resume from a checkpoint of this model, or start a new out"
        )
    model.load_state_dict(weights)


def key_mismatch(model: nn.Module, source) -> str | None:
    """How the tensors of ``source`` (a state dict, or anything with ``keys``, ``in`` and ``get``)
    fail to fit ``model`` ("2 of this model's tensors missing, 0 unknown, 1 of another shape;
    first 'head.weight'"; a tied parameter may be present under one of its names only), or None."""
    tensors = dict(model.state_dict(keep_vars=True))
    names_of: dict[int, list[str]] = {}
    for name, t in tensors.items():
        names_of.setdefault(id(t), []).append(name)
    missing = [n for n, t in tensors.items() if not any(alias in source for alias in names_of[id(t)])]
    unknown = [k for k in source.keys() if k not in tensors]
    get = source.get if hasattr(source, "get") else source.__getitem__
    shapes = [k for k in tensors if k in source and tuple(get(k).shape) != tuple(tensors[k].shape)]
    if not (missing or unknown or shapes):
        return None
    first = (missing or unknown or shapes)[0]
    return (
        f"{len(missing)} of this model's tensors missing, {len(unknown)} unknown, "
        f"{len(shapes)} of another shape; first {first!r}"
    )


def save_weights(module: nn.Module, path: Path, env: DistEnv) -> None:
    """The bare model's state_dict to ``path`` from rank 0 (loadable with ``weights_only=True``).
    All ranks call it: a sharded model's full state dict is gathered from every rank first, by
    torch's ``get_model_state_dict`` (plain keys, full tensors on rank 0's CPU)."""
    if is_sharded(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif env.is_rank0:
        state = module.state_dict()
    if env.is_rank0:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_state_dict_atomic(state, path)
