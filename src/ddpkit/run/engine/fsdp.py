"""``engine="fsdp"``: the model sharded with torch's FSDP2 (``fully_shard``), rank 0's weights first.

Sharded data parallelism is still data parallelism: each rank trains on its share of the batch and
the gradient is the average over the ranks; only the storage of parameters, gradients and
optimizer state is split, each rank holding 1/N of every sharded tensor (a DTensor, Shard(0)).
``fully_shard`` replaces the module's parameters in place, so the module the user calls is their
own (its class becomes FSDP's subclass of it) and ``unwrap`` returns it as it is.

Which modules get their own ``fully_shard`` (one all-gather before their forward, one
reduce-scatter after their backward) is ``groups``: the classes the user names in
``shard_modules``, or the default policy below; the root takes what is left.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.parallel.sync import broadcast_coalesced
from ddpkit.run.config import EngineConfig
from ddpkit.run.engine.forward_order import watch_forward_order

# The default policy: a module gets its own fully_shard when it holds at least MIN_SHARE of the
# model's parameters; one holding more than MAX_SHARE (a backbone wrapping everything) is looked
# into instead, so that no single group gathers most of the model at once. Containers
# (ModuleList, Sequential, ModuleDict) are always looked into: their items are the blocks.
MIN_SHARE = 0.01
MAX_SHARE = 0.5
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def shard(model: nn.Module, env: DistEnv, cfg: EngineConfig) -> nn.Module:
    """``fully_shard`` each group of ``groups(model, cfg)``, then the root; returns ``model`` itself.

    Rank 0's parameters and buffers are broadcast first (FSDP2 does not sync them, and each rank
    then keeps only its shard of what it holds). bf16 is FSDP's mixed precision: bf16 parameters in
    forward and backward, fp32 reductions, fp32 sharded master weights the optimizer updates, and
    fp32 outputs, so a loss computed outside is fp32.
    """
    # Imported here: torch.distributed.fsdp and its DTensor cost every script a second at start-up.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # A model built on meta has nothing to broadcast: every rank gives it the same values once
    # sharded (materialize.py), its real buffers being the same already (check_same_model).
    tensors = [t for t in (*model.parameters(), *model.buffers()) if not t.is_meta]
    if env.world_size > 1:
        broadcast_coalesced(tensors, dist.group.WORLD, 0)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    bf16 = cfg.precision == "bf16"
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
        output_dtype=torch.float32 if bf16 else None,
    )
    # offload: parameters, gradients and optimizer state in pinned host memory, copied to the
    # GPU for each group's forward and backward.
    offload = CPUOffloadPolicy() if cfg.offload else OffloadPolicy()
    sharded = groups(model, cfg.shard_modules)
    for module in sharded:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=cfg.reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload,
        )
    # The root's parameters are needed again as soon as backward starts: torch's advice (and
    # torchtitan's) is to keep them gathered rather than free and gather them again.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)
    type(model).__deepcopy__ = _no_deepcopy  # FSDP2's class for this model: its message, in one line
    watch_forward_order(model, sharded, env)  # over gloo: a rank skipping a group is one line
    if cfg.broadcast_buffers and any(True for _ in model.buffers()):
        model.register_forward_pre_hook(_broadcast_buffers)
        _BROADCASTING.add(model)
    return model


# The sharded models whose buffers are rank 0's before each forward (engine option broadcast_buffers).
_BROADCASTING: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def broadcasts_buffers(model: nn.Module) -> bool:
    """True when ``shard`` made ``model`` copy rank 0's buffers to every rank before each forward."""
    return model in _BROADCASTING


def _no_deepcopy(module: nn.Module, memo: dict) -> None:
    raise ConfigError(
        f"a sharded {type(module).__mro__[2].__name__} cannot be deep-copied (engine='fsdp'): for an EMA use "
        "ema = ddpkit.EMA(model, decay) instead of AveragedModel, and run.track(ema=ema)"
    )


def _broadcast_buffers(module: nn.Module, args: tuple) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) before each forward, as torch's DDP does:
    FSDP2 shards parameters only, and leaves buffers to drift apart per rank otherwise."""
    if dist.get_world_size() > 1 and getattr(module, "require_forward_param_sync", True):
        broadcast_coalesced(list(module.buffers()), dist.group.WORLD, 0)


def groups(model: nn.Module, classes: Iterable[str] = ()) -> list[nn.Module]:
    """The modules that get their own ``fully_shard``, children before parents.

    With ``classes``: every module of those class names (not the root). Without: from the root
    down, every module holding between MIN_SHARE and MAX_SHARE of the parameters that is not a
    container, not looking inside one already chosen. A module whose parameters are also used
    outside it (tied embeddings) stays with its parent: FSDP2 needs a shared parameter in one group.
    """
    classes = tuple(classes)
    total = sum(p.numel() for p in model.parameters())
    tied = _tied(model)
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            own = {id(p) for p in child.parameters()}
            if own & tied:
                visit(child)
                continue
            share = sum(p.numel() for p in child.parameters()) / max(total, 1)
            if classes:
                pick = type(child).__name__ in classes
            else:
                pick = MIN_SHARE <= share <= MAX_SHARE and not isinstance(child, CONTAINERS)
            if pick:
                chosen.append(child)
            elif share > 0:
                visit(child)

    visit(model)
    if classes and not chosen:
        names = sorted({type(m).__name__ for m in model.modules()} - {type(model).__name__})
        raise ConfigError(
            f"shard_modules={list(classes)} matches no module of {type(model).__name__}; "
            f"name some of its classes ({', '.join(names[:12])}), or leave it empty for the default policy"
        )
    return chosen[::-1]  # FSDP2 wants children sharded before the modules around them


def _tied(model: nn.Module) -> set[int]:
    """Parameters reachable under more than one module (``lm_head.weight is wte.weight``)."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(id(module))
    return {pid for pid, mods in owners.items() if len(mods) > 1}


def is_sharded(model: nn.Module) -> bool:
    """True for a module ``fully_shard`` has sharded (the root of a fsdp engine)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported: nothing is sharded
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def set_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2's ``no_sync``: False keeps each micro-batch's gradient unsharded and local, and
    reduce-scatters nothing until a backward with True."""
    model.set_requires_gradient_sync(sync)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters a forward without backward left (an evaluation, or any group
    with ``reshard_after_forward=False``) and register the shards again, in every group: a
    checkpoint and the optimizer's pairing read the registered parameters. Nothing if not sharded."""
    if is_sharded(model):
        for module in model.modules():
            if is_sharded(module):
                module.reshard()
