"""Keeping replicas identical: the construction-time check, and broadcasts of parameters and buffers."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.parallel.errors import DataParallelError
from ddpkit.parallel.flat import flatten, unflatten

_FIX = "build the same model (same code, same config) on every rank before wrapping it in DataParallel"


def param_signature(module: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """(name, shape, dtype, requires_grad) of every parameter, in registration order."""
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]


def verify_same_params(module: nn.Module, process_group: dist.ProcessGroup) -> None:
    """Fail on every rank, naming the first difference, unless all ranks hold the same parameters.

    A collective (all_gather_object): different shapes would otherwise surface much later as a
    hang or a garbled all-reduce. Raises ``DataParallelError``, a ``RuntimeError`` as torch's DDP
    raises for this mistake.

    Args:
        module: this rank's model.
        process_group: the ranks that must agree.
    """
    signatures: list[list | None] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(signatures, param_signature(module), group=process_group)
    reference = signatures[0]
    for rank, signature in enumerate(signatures[1:], start=1):
        problem = first_difference(reference, signature, rank)
        if problem:
            raise DataParallelError(f"DataParallel: the ranks hold different models: {problem}; {_FIX}")


def first_difference(reference: list, other: list, rank: int) -> str | None:
    """Describe the first parameter where rank 0's signature and ``rank``'s differ, or None."""
    for (name0, shape0, dtype0, grad0), (name, shape, dtype, grad) in zip(reference, other, strict=False):
        if name0 != name:
            return f"parameter {name0!r} on rank 0 is {name!r} on rank {rank}"
        for what, mine, theirs in (
            ("shape", shape0, shape),
            ("dtype", dtype0, dtype),
            ("requires_grad", grad0, grad),
        ):
            if mine != theirs:
                return f"parameter {name!r} has {what} {mine} on rank 0 but {theirs} on rank {rank}"
    if len(reference) != len(other):
        holder, longer = (0, reference) if len(reference) > len(other) else (rank, other)
        extra = longer[min(len(reference), len(other))][0]
        return (
            f"rank 0 has {len(reference)} parameters and rank {rank} has {len(other)}; "
            f"the first extra one is {extra!r} on rank {holder}"
        )
    return None


@torch.no_grad()
def broadcast_coalesced(tensors: Iterable[Tensor], process_group: dist.ProcessGroup, group_src: int) -> None:
    """Overwrite ``tensors`` with rank ``group_src``'s values: one broadcast per (dtype, device).

    Flattening first turns dozens of small broadcasts into one, which is what makes the
    per-forward buffer sync cheap.

    Args:
        tensors: the tensors to overwrite in place.
        process_group: the ranks taking part.
        group_src: rank within the group whose values win.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for members in groups.values():
        if len(members) == 1 and members[0].is_contiguous():
            dist.broadcast(members[0], group=process_group, group_src=group_src)
            continue
        flat = flatten(members)
        dist.broadcast(flat, group=process_group, group_src=group_src)
        for tensor, value in zip(members, unflatten(flat, members), strict=True):
            tensor.copy_(value)


def find_tensors(obj: object) -> list[Tensor]:
    """Every tensor inside a forward's output: a tensor, or lists, tuples and dicts of them."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in find_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in find_tensors(item)]
    return []


def map_tensors(obj: object, fn: Callable[[Tensor], Tensor]) -> object:
    """``obj`` with ``fn`` applied to every tensor inside (lists, tuples, namedtuples, dicts)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        mapped = [map_tensors(item, fn) for item in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else type(obj)(mapped)
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(value, fn)) for key, value in obj.items())
    return obj


def call_module(module: nn.Module, *inputs, **kwargs) -> object:
    """``module(*inputs, **kwargs)`` from a frame of ddpkit's own. An engine's forward is not
    traced by torch.compile (as torch's DDP's is not); dynamo starts again at the frames it calls,
    but skips those in torch's own files, so an ``nn.Sequential`` of torch's layers called from
    the engine directly would run uncompiled. This frame is traced, and the module with it."""
    return module(*inputs, **kwargs)


def eager(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``: run eagerly, never traced by torch.compile, with torch._dynamo
    imported at the first call rather than when ddpkit is imported (a large part of start-up,
    docs/engine.md): torch's
    own DDP does the same through ``torch._disable_dynamo``, which this uses where torch has it."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


def _ignored(module: nn.Module) -> set[str]:
    # torch's DDP leaves out what _set_params_and_buffers_to_ignore_for_model names.
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def managed_params(module: nn.Module, named: bool = False) -> list:
    """The parameters a DataParallel syncs (``(name, p)`` pairs with ``named``), in module order."""
    ignored = _ignored(module)
    return [(n, p) if named else p for n, p in module.named_parameters() if n not in ignored]


def managed_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The buffers a DataParallel broadcasts, in module order."""
    ignored = _ignored(module)
    return [b for n, b in module.named_buffers() if n not in ignored]
