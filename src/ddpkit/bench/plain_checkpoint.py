"""The plain ways a script saves and resumes a checkpoint, which ``ddpkit bench checkpoint``
(checkpoint_bench.py) holds ddpkit's against: ``torch.save`` on rank 0 (into a new file renamed,
or over the last), ``dcp.save`` into a new folder, their loads into a new optimizer, and the
plainest background save."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from ddpkit.run.engine.wrap import unwrap


def torch_save(model, optimizer, path: Path, atomic: bool) -> None:
    """The tutorials' save on rank 0: ``torch.save`` of the state dicts, fsynced; ``atomic``: into a
    new file renamed over the last (what a save that may be killed needs), else over the same file."""
    if dist.get_rank() != 0:
        return
    target = path.with_suffix(".tmp") if atomic else path
    torch.save({"model": unwrap(model).state_dict(), "optim": optimizer.state_dict()}, target)
    with open(target, "rb+") as f:
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


def dcp_save(model, optimizer, folder: Path, last: Path | None) -> None:
    """``dcp.save`` into a new folder, and the last one removed (as torchtitan's keep_latest_k)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(unwrap(model), optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    dist.barrier()
    if last is not None and dist.get_rank() == 0:
        shutil.rmtree(last)


def dcp_load(model, folder: Path) -> None:
    """What a plain script resuming through DCP does, as a resumed Run does: a new optimizer (so
    its state is made to load into), ``dcp.load`` of model and optimizer, both set."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    module = unwrap(model)
    for param in module.parameters():
        param.grad = None  # as in a new process: DCP makes the new optimizer's state by a step at lr 0
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def torch_load(model, path: Path) -> None:
    """What a plain script resuming from ``torch.save``'s file does: ``torch.load`` on every rank,
    the model's and a new optimizer's ``load_state_dict``."""
    module = unwrap(model)
    state = torch.load(path, weights_only=True, map_location=next(module.parameters()).device)
    module.load_state_dict(state["model"])
    torch.optim.AdamW(module.parameters(), lr=1e-4).load_state_dict(state["optim"])


def plain_async(model, optimizer, path: Path, engine: str, group) -> Callable[[], object]:
    """The plain background save, started; returns the wait for it. Rank 0 copies the state dicts
    to the CPU and a thread writes them with ``torch.save`` (torch engine), or every rank's
    ``dcp.async_save`` (fsdp), over ``group``, a gloo group of its own (as ddpkit's: never the training's)."""
    if engine == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        return dcp.async_save(state, checkpoint_id=str(path), process_group=group).result
    if dist.get_rank() != 0:
        return lambda: None
    state = {"model": unwrap(model).state_dict(), "optim": optimizer.state_dict()}
    copied = tree_map(lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, state)
    thread = threading.Thread(target=torch.save, args=(copied, path))
    thread.start()
    return thread.join
