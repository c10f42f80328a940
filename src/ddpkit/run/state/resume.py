"""Whether, and from where, a Run continues: the checkpoint every rank loads at ``Run()``.

Rank 0 chooses (``checkpoint/choose.py``), every rank checks a share of the choice's files, and
they fall back together; a fresh start refuses a folder that holds an earlier run, and a command
that cannot train a finished run further has nothing to do (``finished_here``). What a checkpoint
holds, and how it is saved and restored, is ``run/state/checkpoints.py``'s.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.checkpoint import CheckpointError, load_checkpoint, resolve_resume
from ddpkit.checkpoint.kept import KeptFiles
from ddpkit.checkpoint.lock import OutLock
from ddpkit.checkpoint.manifest import verify_share
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.config import CheckpointConfig
from ddpkit.run.state import checkpoints

log = logging.getLogger(__name__)


def resume_point(
    out: Path | None, cfg: CheckpointConfig, env: DistEnv, lock: OutLock | None
) -> tuple[str | None, KeptFiles | None]:
    """The one decision of whether, and from where, this run continues: the checkpoint's path and
    the DCP files this rank hashed, kept mapped for its loads (``checkpoint/kept.py``). Collective.

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
            return None, None
        path = Path(choice[0])
        kept = KeptFiles(path)
        everyone: list = [None] * env.world_size
        dist.all_gather_object(everyone, verify_share(path, env.rank, env.world_size, kept.check))
        problems = [problem for found in everyone for problem in found]
        if not problems:
            return str(path), kept
        kept.release()
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


def finished_here(
    where: Path | str | None, saved: dict | None, steps: int | None, env: DistEnv
) -> str | None:
    """The one line to say, on every rank, when ``saved`` is a finished run's final checkpoint that
    this command cannot train on: the same command again (its arguments, script text and
    ``steps``), or a ``steps`` no higher than the step it finished at, which the loader stops at
    at once. None when it may train on: another command (more epochs), or the same process making
    another Run, or a worker the elastic agent restarted (its run failed after finishing).
    Collective."""
    if saved is None or saved.get("finished") is None or env.restart_count > 0:
        return None  # every rank loaded the same checkpoint: all return here alike, no collective
    line: list[str | None] = [None]
    if env.is_rank0:
        line = [_nothing_to_do(where, saved, steps)]
    if env.world_size > 1:
        dist.broadcast_object_list(line, src=0)
    return line[0]


def _nothing_to_do(where: Path | str | None, saved: dict, steps: int | None) -> str | None:
    then, now, step = saved["finished"], checkpoints.command(steps), saved["step"]
    if then.get("pid") == now["pid"]:
        return None
    same = all(then.get(key) == now[key] for key in ("argv", "script", "steps"))
    if not same and (steps is None or steps > step):
        return None
    head = "this command's finished run" if same else "a finished run"
    asks = "" if same else f" and steps={steps} asks for no more"
    return f"ddpkit: {where} holds {head} (step {step}){asks}; nothing to do: {further(saved, steps)}"


def trained_nothing(where: Path | str, saved: dict, steps: int | None) -> str:
    """The line of a finished run resumed by another command whose loop ran no step (no more epochs)."""
    return (
        f"ddpkit: {where} holds a finished run (step {saved['step']}) and this command trained no "
        f"step, so it is left as it was: {further(saved, steps)}"
    )


def further(saved: dict, steps: int | None) -> str:
    """How to train a finished run further: a higher ``steps``, more epochs, or another out."""
    step, then = saved["step"], saved["finished"]
    on_epochs = then.get("steps") is None or step < then["steps"]  # its loop ended before the budget
    epoch = then.get("epoch")
    epochs = f"raise the loop's epochs above {epoch}" if epoch is not None else "loop over more epochs"
    ways = [f"pass steps= above {step}"] if steps is not None and steps <= step else []
    ways += [epochs] if on_epochs or not ways else []
    return f"to train further {' and '.join(ways)}, or use another out to start over"
