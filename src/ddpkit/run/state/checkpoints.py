"""What a Run's checkpoint holds, and how each registered object gets its part.

A checkpoint is ``{"step", "world_size", "rng": [one dict per rank], "state": {name: state_dict},
"frozen": {name: [parameter names]}}`` where the names are those the user registered
(``run.setup``, ``run.track``, ``run.loader``), every one of them through its own ``state_dict()``
/ ``load_state_dict()``; ``frozen`` holds each module's parameters without ``requires_grad``
(a backbone unfrozen at epoch 1 is trainable in a run resumed at epoch 2, whose loop never runs
that line again). Rank 0 writes it atomically with a manifest of digests (``checkpoint/store.py``);
every rank loads the same one, chosen by ``run/state/resume.py``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.checkpoint import (
    capture_rng,
    restore_rng,
    save_checkpoint,
)
from ddpkit.checkpoint.background import BackgroundWriter
from ddpkit.checkpoint.dcp import SHARDED, save_sharded, save_sharded_async
from ddpkit.checkpoint.kept import KeptFiles
from ddpkit.checkpoint.store import begin_save, commit_save
from ddpkit.diagnostics import check_replicas_agree
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.config import CheckpointConfig
from ddpkit.run.engine.wrap import unwrap
from ddpkit.run.monitor import notices
from ddpkit.run.state.dcp_state import restore_parts, sharded_parts, spreads

OPTIONAL = "ddpkit_best"  # run.save_best's part (run/state/best.py), which checkpoints before it lack


def check_names(path: str, saved: dict, registered: list[str]) -> None:
    """Refuse a checkpoint whose parts do not match what this run registered, in either direction."""
    missing = [name for name in saved if name not in registered]
    extra = [name for name in registered if name not in saved and name != OPTIONAL]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"it holds {missing}, which this run did not register (run.track(NAME=obj))")
        if extra:
            parts.append(f"this run registered {extra}, which it does not hold")
        raise ConfigError(
            f"cannot resume from {path}: {'; '.join(parts)}; register the same objects under the same "
            "names as the run that wrote it, or pass resume='never' with another out"
        )


def restore_run(
    path: str,
    saved: dict,
    kept: KeptFiles | None,
    objects: dict[str, Any],
    models: dict[str, nn.Module],
    env: DistEnv,
    step: int,
    check: bool = True,
) -> None:
    """At the loop's first batch: every registered object gets its part of the checkpoint at
    ``path``, the generators their state, and the replicas are checked to agree (``check``: the
    one collective, and the line that says so; a run that leaves as it was makes neither). The DCP
    files this rank hashed at resume are read from ``kept``, then dropped."""
    check_names(path, saved["state"], list(objects))
    restore(objects, saved, env.rank, restore_parts(path, saved["state"], objects, kept))
    if kept is not None:
        kept.release()
    if not check:
        return
    for name, model in models.items():
        check_replicas_agree(unwrap(model), env, f"after loading {path} ({name})")
    if env.is_rank0:
        print(f"ddpkit: resumed from {path} at step {step}", flush=True)


def restore(objects: dict[str, Any], saved: dict, rank: int, sharded: set[str] = frozenset()) -> None:
    """Give each registered object its part (``sharded``: those DCP restored); optimizers last, so
    the learning rates in their param groups are the saved ones and not what a scheduler's constructor set."""
    for name, frozen in saved.get("frozen", {}).items():  # the engine re-plans at its next forward
        for param_name, param in objects[name].named_parameters():
            param.requires_grad_(param_name not in frozen)
    last = [n for n, obj in objects.items() if isinstance(obj, torch.optim.Optimizer)]
    changes = notices.compare_settings(objects, saved.get("settings", {}))
    if changes and rank == 0:
        notices.resumed_with_other_settings(changes, notices.not_compared(objects))
    for name in [n for n in objects if n not in last] + last:
        if name not in sharded and name in saved["state"]:  # OPTIONAL: not in older checkpoints
            objects[name].load_state_dict(saved["state"][name])
    rng = saved["rng"]
    # Same world size: each rank continues its own random streams; otherwise ranks map modulo.
    restore_rng(rng[rank % len(rng)])


def command(steps: int | None) -> dict:
    """What makes a command the same one again: the script's arguments, its text (an edited
    ``EPOCHS = 20`` is another command) and the step limit; and the process that finished it."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    text = hashlib.sha256(script.read_bytes()).hexdigest() if script is not None and script.is_file() else ""
    return {"argv": list(sys.argv), "script": text, "steps": steps, "pid": this_process()}


def this_process() -> int:
    """The process id a final checkpoint records (a test stands in another process here)."""
    return os.getpid()


def save(
    directory: Path,
    step: int,
    objects: dict[str, Any],
    env: DistEnv,
    cfg: CheckpointConfig,
    finished: dict | None,
    writer: BackgroundWriter | None = None,
) -> Path | None:
    """Checkpoint every registered object at ``step``. Collective: every rank calls it, rank 0 writes.

    An object whose state differs by rank (``per_rank_state``: a stream's position) is saved as the
    list of every rank's ``state_dict()``, gathered with the generators' states. ``finished``
    marks the final checkpoint with the command that finished it (``command``) and the loader's
    epoch then. With ``writer`` (``async_save``), rank 0 returns once a host copy of the state
    is made, and each rank once DCP has copied its shards; the writers' threads write them
    (checkpoint/background.py, dcp.py)."""
    own = {name: obj.state_dict() for name, obj in objects.items() if getattr(obj, "per_rank_state", False)}
    everyone: list[dict | None] = [None] * env.world_size
    dist.all_gather_object(everyone, {"rng": capture_rng(), "own": own})
    spread = spreads(objects, env.world_size, cfg.sharded_save, cfg.async_save)
    shards = sharded_parts(objects, spread)  # a sharded model and its optimizers: every rank writes them
    if not env.is_rank0:
        return _save_shards(directory, step, None, shards, False, cfg, writer) if shards else None
    parts: dict[str, object] = {}
    for name, obj in objects.items():
        if name in shards:
            parts[name] = SHARDED
        elif name in own:
            parts[name] = [mine["own"][name] for mine in everyone]  # each rank's own, in rank order
        else:
            parts[name] = obj.state_dict()
    state = {
        "step": step,
        "world_size": env.world_size,
        "rng": [mine["rng"] for mine in everyone],
        "state": parts,
        "frozen": {
            name: [param_name for param_name, p in obj.named_parameters() if not p.requires_grad]
            for name, obj in objects.items()
            if isinstance(obj, nn.Module)
        },
        "finished": finished,
        "settings": notices.settings(objects),  # hyper-parameters as the script set them
    }
    if shards:
        return _save_shards(directory, step, state, shards, True, cfg, writer)
    if writer is None:
        return save_checkpoint(directory, step, state, keep_last=cfg.keep_last)
    writer.wait()  # one write at a time: begin_save clears what an unfinished one left
    final, tmp = begin_save(directory, step, state, cfg.keep_last)
    copied = writer.copy(state)
    writer.submit(lambda: commit_save(final, tmp, step, copied, cfg.keep_last))
    return final


def _save_shards(
    directory: Path,
    step: int,
    state: dict | None,
    shards: dict[str, Any],
    rank0: bool,
    cfg: CheckpointConfig,
    writer: BackgroundWriter | None,
) -> Path | None:
    """Every rank writes its shards through DCP, now or (``writer``: async_save) in the background."""
    if writer is None:
        return save_sharded(directory, step, state, shards, rank0, cfg.keep_last)
    return save_sharded_async(directory, step, state, shards, rank0, cfg.keep_last, writer)
