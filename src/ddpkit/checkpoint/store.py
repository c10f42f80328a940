"""Atomic checkpoint saves, verified loads and retention of the last K (which checkpoint a run
resumes from is ``checkpoint/choose.py``'s).

A run's checkpoint directory::

    checkpoints/
      step-00000100/              state.pt, manifest.json
      step-00000200/              state.pt, manifest.json
      .step-00000300.1f2e3d4c.tmp/  a save in progress, or one a crash interrupted

A save writes into a hidden sibling, fsyncs it, and renames it into place, so a ``step-N`` name
only ever appears complete; older checkpoints are pruned only after that. A crash at any point
therefore leaves the previous good checkpoint in place, and the next save removes the leftovers.
Only one process (global rank 0) may save into a directory; any number may load.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.files import HashedWrite, exchange, fsync_dir, raise_if_disk_full, state_bytes
from ddpkit.checkpoint.loadable import weights_only_problem, weights_only_reason
from ddpkit.checkpoint.manifest import (
    STATE,
    checkpoint_name,
    step_of,
    verify_checkpoint,
    write_manifest,
)
from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)

# What a save leaves behind when killed: its temporary dir, or (where RENAME_EXCHANGE is missing)
# the checkpoint it was replacing, or one that retention was deleting.
_LEFTOVER = re.compile(r"\.(step-\d{8,})\.[0-9a-f]+(\.replaced)?\.tmp")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it, what is wrong, and what to do."""


def save_checkpoint(directory: str | Path, step: int, state: dict, keep_last: int = 2) -> Path:
    """Write ``state`` as ``directory/step-{step:08d}/`` atomically, then keep only the newest checkpoints.

    Args:
        directory: the run's checkpoint directory; created if missing.
        step: the optimizer step the state belongs to; names the checkpoint.
        state: what ``torch.load(weights_only=True)`` can read back: tensors, numbers, strings,
            None, and lists, tuples and dicts of those (state_dicts of modules and optimizers are).
        keep_last: how many checkpoints to keep, newest by step; the one just saved is always kept.

    Returns:
        The checkpoint directory written.

    Raises:
        ConfigError: bad ``step`` or ``keep_last``, or ``state`` holds objects a resume could not load.
        DiskFullError: the disk filled up; the partial copy is removed and the previous checkpoint stays.
    """
    final, tmp = begin_save(directory, step, state, keep_last)
    return commit_save(final, tmp, step, state, keep_last)


def begin_save(directory: str | Path, step: int, state: dict, keep_last: int) -> tuple[Path, Path]:
    """Check the arguments, remove what interrupted saves left, and make the hidden folder a
    checkpoint is written into: ``(final, tmp)``; a sharded save's ranks write there first."""
    _check_save_args(step, state, keep_last)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(directory)
    final = directory / checkpoint_name(step)
    tmp = _temp_path(final)
    tmp.mkdir()
    return final, tmp


def commit_save(
    final: Path,
    tmp: Path,
    step: int,
    state: dict,
    keep_last: int,
    files: tuple = (),
    known: dict | None = None,
) -> Path:
    """Write ``state`` into ``tmp`` with a manifest of it and of ``files`` (already there; their
    entries in ``known`` where their writers hashed them), rename ``tmp`` to ``final`` and prune
    to ``keep_last``. On any error ``tmp`` is removed."""
    try:
        _write(tmp, step, state, files, known or {})
        old = _commit(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        earlier = list_checkpoints(final.parent)
        kept = f"the previous checkpoint {earlier[-1]} is kept" if earlier else "no earlier checkpoint"
        raise_if_disk_full(exc, final, state_bytes(state), kept)
        raise
    fsync_dir(final.parent)  # the rename is durable only once the parent's entry is on disk
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _prune(final.parent, keep_last, final)
    return final


def _check_save_args(step: int, state: dict, keep_last: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"checkpoint step must be an int >= 0, got {step!r}")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ConfigError(f"keep_last must be an int >= 1, got {keep_last!r}; pass --keep-last 1 or more")
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint state must be a dict, got {type(state).__name__}")


def _temp_path(final: Path, kind: str = "") -> Path:
    return final.with_name(f".{final.name}.{secrets.token_hex(4)}{kind}.tmp")


def _write(tmp: Path, step: int, state: dict, files: tuple, known: dict) -> None:
    # Hashed (xxh3_128) as torch.save hands the bytes over: nothing is read back for the manifest.
    with HashedWrite(open(tmp / STATE, "wb")) as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _check_loadable(tmp / STATE, step)
    write_manifest(tmp, step, [STATE, *files], {**known, STATE: f.entry()})
    fsync_dir(tmp)


def _check_loadable(path: Path, step: int) -> None:
    """Fail the save, not the resume hours later, when the state holds what weights_only refuses."""
    if (problem := weights_only_problem(path)) is not None:
        raise ConfigError(
            f"checkpoint state for step {step} cannot be loaded: {problem}; keep the state to tensors, "
            "numbers, strings and lists/tuples/dicts of them (torch.from_numpy for numpy arrays, "
            ".state_dict() for objects)"
        )


def _commit(tmp: Path, final: Path) -> Path | None:
    """Rename ``tmp`` to ``final``; returns where a replaced old checkpoint now is, to delete."""
    if not final.exists():
        os.replace(tmp, final)
        return None
    if exchange(tmp, final):
        return tmp  # one atomic swap: ``final`` was never missing, even for a moment
    # Two renames: between them ``final`` is missing, and the next save restores it (_clean_leftovers).
    old = _temp_path(final, ".replaced")
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)
        raise
    return old


def _clean_leftovers(directory: Path) -> None:
    for entry in directory.iterdir():
        match = _LEFTOVER.fullmatch(entry.name)
        if match is None:
            continue
        target = directory / match.group(1)
        if match.group(2) and not target.exists() and not verify_checkpoint(entry):
            os.replace(entry, target)
            fsync_dir(directory)
            log.warning("restored %s, which an interrupted save was replacing", target)
            continue
        log.info("removing %s, left by an interrupted save", entry)
        shutil.rmtree(entry, ignore_errors=True)


def _prune(directory: Path, keep_last: int, saved: Path) -> None:
    checkpoints = list_checkpoints(directory)
    newer = [p for p in checkpoints if step_of(p) > step_of(saved)]
    if newer:
        log.warning(
            "%s holds checkpoints newer than %s, the one just saved (from an earlier run?); "
            "--resume auto would pick %s",
            directory,
            saved.name,
            newer[-1].name,
        )
    for path in checkpoints[:-keep_last]:
        if path != saved:
            # Hide it first: a crash during rmtree then leaves a leftover, not a half checkpoint.
            trash = _temp_path(path)
            os.replace(path, trash)
            shutil.rmtree(trash, ignore_errors=True)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoint directories (``step-N``) in ``directory``, oldest step first.

    Temporary and leftover directories are skipped; contents are not checked (see ``verify_checkpoint``).

    Args:
        directory: a run's checkpoint directory; a missing one has no checkpoints.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if step_of(p) is not None and p.is_dir()]
    return sorted(found, key=step_of)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", verify: bool = True) -> dict:
    """Verify a checkpoint against its manifest, then load its state.

    Args:
        path: a checkpoint directory such as ``OUT/checkpoints/step-00000100``.
        map_location: where tensors land; pass this rank's device so no rank allocates on GPU 0.
        verify: hash every file first; False when the ranks have verified it together already.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete, corrupt, or not weights_only-loadable.
    """
    path = Path(path)
    problems = verify_checkpoint(path) if verify else []
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is corrupt ({'; '.join(problems)}); resume from another one "
            "(--resume PATH), or start over (--resume never)"
        )
    try:
        # Mapped, not read: the pages the hash brought into the page cache are the ones loaded,
        # so state.pt comes from storage once (the ranks' shares hash it where it is loaded).
        mapped = torch.load(path / STATE, map_location=map_location, weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"checkpoint {path} holds objects torch.load(weights_only=True) refuses "
            f"({weights_only_reason(exc)}); it was not written by save_checkpoint, so rewrite it with that"
        ) from exc
    return _owned(mapped)


def _owned(value: Any) -> Any:
    """``value`` with every CPU tensor copied out of the file's mapping into memory of its own: a
    mapped tensor an optimizer keeps as its state would hold the file, and its disk space, for the
    rest of the run, after the checkpoint's rotation removed it."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.device.type == "cpu" else value
    if isinstance(value, dict | list):  # just loaded, ours to change in place (any subclass)
        for key in value.keys() if isinstance(value, dict) else range(len(value)):
            value[key] = _owned(value[key])
    elif isinstance(value, tuple):
        items = [_owned(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
