"""Which checkpoint a run continues from: the newest good one, or the one ``--resume`` names.

Choosing reads manifests and sizes (``verify=False``) when the ranks then hash the chosen
checkpoint's files together (``manifest.verify_share``, run/state/checkpoints.py), or every file
(``verify=True``, the default: one process alone, ``ddpkit inspect``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ddpkit.checkpoint.loadable import weights_only_problem
from ddpkit.checkpoint.manifest import STATE, quick_problems, verify_checkpoint
from ddpkit.checkpoint.store import CheckpointError, list_checkpoints, load_checkpoint
from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)


def newest_good(directory: str | Path, verify: bool = True, skip: frozenset = frozenset()) -> Path | None:
    """The newest checkpoint in ``directory`` that verifies, warning about each newer bad one.

    Args:
        directory: a run's checkpoint directory.
        verify: hash every file; False reads manifests and sizes only (the ranks then hash the
            chosen one's files together, ``manifest.verify_share``).
        skip: checkpoints already found bad (by the ranks' hashing).

    Returns:
        The checkpoint directory, or None when ``directory`` holds no checkpoints.

    Raises:
        CheckpointError: there are checkpoints, but none verifies.
    """
    bad: list[tuple[Path, list[str]]] = []
    for path in reversed(list_checkpoints(directory)):
        if path in skip:
            continue
        problems = verify_checkpoint(path) if verify else quick_problems(path)
        if not problems and (refused := weights_only_problem(path / STATE)) is not None:
            problems = [refused]  # the manifest matches, but the pickle is not one a resume may load
        if not problems:
            for bad_path, bad_problems in bad:
                log.warning(
                    "checkpoint %s is corrupt (%s); falling back to %s",
                    bad_path,
                    "; ".join(bad_problems),
                    path,
                )
            return path
        bad.append((path, problems))
    if not bad:
        return None
    found = ", ".join(f"{p.name} ({'; '.join(problems)})" for p, problems in bad)
    raise CheckpointError(
        f"no good checkpoint in {directory}: {found}; restore a copy of one, or start over (--resume never)"
    )


def load_latest(directory: str | Path, map_location: str | torch.device = "cpu") -> tuple[Path, dict] | None:
    """Load the newest good checkpoint in ``directory``; corrupt newer ones are skipped with a warning.

    Args:
        directory: a run's checkpoint directory.
        map_location: where tensors land (this rank's device).

    Returns:
        ``(checkpoint directory, state)``, or None when ``directory`` holds no checkpoints.

    Raises:
        CheckpointError: there are checkpoints, but none is good.
    """
    path = newest_good(directory)
    return None if path is None else (path, load_checkpoint(path, map_location))


def resolve_resume(
    directory: str | Path, resume: str, verify: bool = True, skip: frozenset = frozenset()
) -> Path | None:
    """The checkpoint the ``--resume`` flag names: ``auto``, ``never`` or a checkpoint directory.

    Args:
        directory: the run's checkpoint directory, searched by ``auto``.
        resume: ``auto`` (newest good checkpoint, None when there is none), ``never`` (None),
            or the path of a checkpoint directory, which must exist and verify.
        verify, skip: as for ``newest_good``.

    Raises:
        ConfigError: ``resume`` is a path that does not exist or is not a good checkpoint.
        CheckpointError: ``auto`` found checkpoints, but none is good.
    """
    if resume == "never":
        return None
    if resume == "auto":
        return newest_good(directory, verify, skip)
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"--resume {resume!r} does not exist; pass a checkpoint directory, auto or never")
    problems = verify_checkpoint(path) if verify else quick_problems(path)
    if problems:
        inside = list_checkpoints(path)
        hint = f"it holds checkpoints, such as {inside[-1]}, so pass one of them" if inside else ""
        hint = hint or "pass another checkpoint directory, auto or never"
        raise ConfigError(f"--resume {resume!r} is not a good checkpoint ({'; '.join(problems)}); {hint}")
    return path
