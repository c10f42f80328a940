"""On fsdp over gloo, every rank calls the same sharded modules in the same order, or one line says where not.

Each sharded group's forward all-gathers its parameters from every rank. A rank that skips a
block (a branch on its own data) or runs one more calls another group's all-gather than its
peers: where the sizes differ, gloo aborts every process (``SIGABRT``, "Received data size
doesn't match expected size"); where they are equal, the rank silently computes with another
group's weights. So before each group's forward (and before each ``run.backward``) the ranks
all-gather which group they are at, 8 bytes, and a disagreement is one ``ConfigError`` on every
rank, naming what each ran.

Over gloo only, where it costs one small collective a group (priced in docs/fsdp.md) and where
the abort would otherwise come. On NCCL the check would need a host sync per group, so a
mismatch there shows as a hang, which the collective watchdog names with every rank's stack.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.parallel.sync import eager

BACKWARD = "run.backward"  # the point after the last group's forward every rank must reach together
_PLACES: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()  # model -> its places


def watch_forward_order(model: nn.Module, sharded: list[nn.Module], env: DistEnv) -> None:
    """Check, before each sharded group's forward, that every rank is at the same group."""
    if env.world_size == 1 or env.backend != "gloo":
        return
    names = {id(m): name for name, m in model.named_modules()}
    places = [names[id(m)] or type(model).__name__ for m in (*sharded, model)] + [BACKWARD]
    _PLACES[model] = places
    for index, module in enumerate((*sharded, model)):
        # prepend: before FSDP2's own pre-forward hook, which starts the all-gather.
        module.register_forward_pre_hook(partial(_before_forward, places, index), prepend=True)


def agree_before_backward(models: list[nn.Module]) -> None:
    """``run.backward``: every rank is done with its forwards (one that is not would gather next)."""
    for model in models:
        places = _PLACES.get(model)
        if places is not None:
            _agree(places, len(places) - 1)


def _before_forward(places: list[str], index: int, module: nn.Module, args: tuple) -> None:
    _agree(places, index)


@eager
def _agree(places: list[str], index: int) -> None:
    mine = torch.tensor([index], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    at = [int(t) for t in everyone]
    if len(set(at)) > 1:
        rank = dist.get_rank()
        other = next(r for r, i in enumerate(at) if i != index)
        raise ConfigError(
            f"rank {rank} is at {_say(places[index])} while rank {other} is at {_say(places[at[other]])}: "
            "with engine='fsdp' every rank must call the same sharded modules' forwards in the same "
            "order (each gathers its weights from all ranks); make the branch that skips or adds a "
            "module the same on every rank"
        )


def _say(place: str) -> str:
    return place if place == BACKWARD else f"{place}'s forward"
