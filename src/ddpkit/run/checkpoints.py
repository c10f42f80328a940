"""What a Run's checkpoint holds, where it is resumed from, and how each registered object gets its part.

A checkpoint is ``{"step", "world_size", "rng": [one dict per rank], "state": {name: state_dict},
"frozen": {name: [parameter names]}}`` where the names are those the user registered
(``run.setup``, ``run.track``, ``run.loader``), every one of them through its own ``state_dict()``
/ ``load_state_dict()``; ``frozen`` holds each module's parameters without ``requires_grad``
(a backbone unfrozen at epoch 1 is trainable in a run resumed at epoch 2, whose loop never runs
that line again). Rank 0 writes it
atomically with a manifest of digests (``checkpoint/store.py``); every rank loads the same one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.checkpoint import (
    CheckpointError,
    capture_rng,
    load_checkpoint,
    resolve_resume,
    restore_rng,
    save_checkpoint,
)
from ddpkit.checkpoint.background import BackgroundWriter, host_copy
from ddpkit.checkpoint.dcp import SHARDED, save_sharded
from ddpkit.checkpoint.lock import OutLock
from ddpkit.checkpoint.manifest import verify_share
from ddpkit.checkpoint.store import begin_save, commit_save
from ddpkit.diagnostics import check_replicas_agree
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run import notices
from ddpkit.run.config import CheckpointConfig
from ddpkit.run.engine import unwrap
from ddpkit.run.sharded_state import restore_parts, sharded_parts, spreads

log = logging.getLogger(__name__)
OPTIONAL = "ddpkit_best"  # run.save_best's part (run/best.py), which checkpoints before it lack


def resume_point(out: Path | None, cfg: CheckpointConfig, env: DistEnv, lock: OutLock | None) -> str | None:
    """The one decision of whether, and from where, this run continues. Collective.

    Rank 0 takes the folder's lock (one run per folder), chooses from manifests and sizes (so
    every rank loads the same checkpoint even if a newer one appears while they look) and
    broadcasts the path, or the error that stops the run, so every rank raises it instead of
    waiting for rank 0. Then every rank hashes its share of the chosen checkpoint's files (each
    file once, by one rank) and they agree in one gather: a bad file anywhere sends every rank
    back to the previous checkpoint together. A worker restarted by the elastic agent always
    takes the newest good checkpoint: its run wrote it.
    """
    bad: set[Path] = set()
    while True:
        choice: list = [None, None]
        if env.is_rank0:
            try:
                if lock is not None and not bad:
                    lock.acquire()
                choice = [_choose(out, cfg, env, frozenset(bad)), None]
            except (ConfigError, CheckpointError) as exc:
                choice = [None, str(exc)]
        dist.broadcast_object_list(choice, src=0)
        if choice[1] is not None:
            raise ConfigError(choice[1])
        if choice[0] is None:
            return None
        path = Path(choice[0])
        everyone: list = [None] * env.world_size
        dist.all_gather_object(everyone, verify_share(path, env.rank, env.world_size))
        problems = [problem for found in everyone for problem in found]
        if not problems:
            return str(path)
        if _explicit(out, cfg, env):
            raise ConfigError(f"--resume {str(path)!r} is not a good checkpoint ({'; '.join(problems)})")
        if env.is_rank0:
            log.warning(
                "checkpoint %s is corrupt (%s); falling back to the previous one", path, "; ".join(problems)
            )
        bad.add(path)


def _explicit(out: Path | None, cfg: CheckpointConfig, env: DistEnv) -> bool:
    """True when the run resumes from the path it was given, which has no previous one to fall to."""
    return cfg.resume not in ("auto", "never") and (out is None or env.restart_count == 0)


def _choose(out: Path | None, cfg: CheckpointConfig, env: DistEnv, bad: frozenset) -> str | None:
    if out is None:
        if cfg.resume not in ("auto", "never"):
            return str(resolve_resume(Path("."), cfg.resume, verify=False))
        return None
    resume = "auto" if env.restart_count > 0 else cfg.resume
    found = resolve_resume(out / "checkpoints", resume, verify=False, skip=bad)
    if found is None and env.restart_count == 0 and not bad:
        _refuse_to_overwrite(out, cfg)
    return str(found) if found else None


def _refuse_to_overwrite(out: Path, cfg: CheckpointConfig) -> None:
    """A fresh start may not write into a folder that holds an earlier run: nothing of it is lost."""
    earlier = [p.name for p in (out / "checkpoints", out / "metrics.jsonl") if p.exists()]
    if not earlier:
        return
    if (out / "checkpoints").exists() and cfg.resume == "never":
        fix = "pass resume='auto' to continue it"
    else:  # killed before its first checkpoint, or save_every=0
        fix = "it wrote no checkpoint to continue from; remove its files to start it over"
    raise ConfigError(
        f"out={str(out)!r} already holds a run ({', '.join(earlier)}); {fix}, or choose another out"
    )


def load(path: str, device: torch.device) -> dict:
    """Load a checkpoint written by ``save`` (verified by ``resume_point``), onto this rank's device."""
    state = load_checkpoint(path, map_location=device, verify=False)  # the ranks verified it together
    if not isinstance(state, dict) or "state" not in state or "rng" not in state:
        raise ConfigError(
            f"{path} is not a ddpkit.Run checkpoint (it lacks 'state' and 'rng'); "
            "resume a Run from its own OUT/checkpoints, or pass resume='never'"
        )
    return state


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
    path: str, saved: dict, objects: dict[str, Any], models: dict[str, nn.Module], env: DistEnv, step: int
) -> None:
    """At the loop's first batch: every registered object gets its part of the checkpoint at
    ``path``, the generators their state, and the replicas are checked to agree."""
    check_names(path, saved["state"], list(objects))
    restore(objects, saved, env.rank, restore_parts(path, saved["state"], objects))
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
        notices.resumed_with_other_settings(changes)
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


def finished_here(saved: dict | None, steps: int | None, env: DistEnv) -> bool:
    """True on every rank when ``saved`` is the final checkpoint of this very command, run again
    (a new process; one that finished it and makes another Run continues). Collective."""
    if saved is None or saved.get("finished") is None:
        return False  # every rank loaded the same checkpoint: all return here alike, no collective
    done = [False]
    if env.is_rank0:
        now, then = command(steps), dict(saved["finished"])
        done = [then.pop("pid") != now.pop("pid") and then == now]
    if env.world_size > 1:
        dist.broadcast_object_list(done, src=0)
    return done[0]


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
    marks the final checkpoint with the command that finished it (``command``). With ``writer``
    (``async_save``), rank 0 returns once a host copy of the state is made; the writer's thread
    writes it (checkpoint/background.py)."""
    own = {name: obj.state_dict() for name, obj in objects.items() if getattr(obj, "per_rank_state", False)}
    everyone: list[dict | None] = [None] * env.world_size
    dist.all_gather_object(everyone, {"rng": capture_rng(), "own": own})
    spread = spreads(objects, env.world_size, cfg.sharded_save, cfg.async_save)
    shards = sharded_parts(objects, spread)  # a sharded model and its optimizers: every rank writes them
    if not env.is_rank0:
        return save_sharded(directory, step, None, shards, False, cfg.keep_last) if shards else None
    parts = {name: SHARDED if name in shards else [mine["own"][name] for mine in everyone] if name in own
             else obj.state_dict() for name, obj in objects.items()}  # fmt: skip
    state = {
        "step": step,
        "world_size": env.world_size,
        "rng": [mine["rng"] for mine in everyone],
        "state": parts,
        "frozen": {
            name: [param_name for param_name, p in obj.named_parameters() if not p.requires_grad]
            for name, obj in objects.items()
            if isinstance(obj, nn.Module)
        },  # fmt: skip
        "finished": finished,
        "settings": notices.settings(objects),  # hyper-parameters as the script set them
    }
    if shards:
        return save_sharded(directory, step, state, shards, True, cfg.keep_last)
    if writer is None:
        return save_checkpoint(directory, step, state, keep_last=cfg.keep_last)
    writer.wait()  # one write at a time: begin_save clears what an unfinished one left
    final, tmp = begin_save(directory, step, state, cfg.keep_last)
    copied = host_copy(state)
    writer.submit(lambda: commit_save(final, tmp, step, copied, cfg.keep_last))
    return final
