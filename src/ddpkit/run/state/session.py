"""What a Run holds for its whole life, outside its steps: the process group, OUT's lock, and the
checkpoint it continues from."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ddpkit.checkpoint.kept import KeptFiles
from ddpkit.checkpoint.lock import OutLock
from ddpkit.dist import DistEnv, current_env, destroy, init_distributed
from ddpkit.dist.init import DEFAULT_TIMEOUT, set_collective_timeout
from ddpkit.launch.restarts import EVENTS, note_out
from ddpkit.run.config import CheckpointConfig, DiagnosticsConfig
from ddpkit.run.state import resume


class Session:
    """One process's membership of the run: joined at ``Run()``, left at its end.

    A script that joined a process group itself keeps it: the session neither creates nor
    destroys it.

    Args:
        backend: ``auto``, ``gloo``, ``nccl`` or ``mpi``.
        diag: the start-up and collective timeouts.
    """

    def __init__(self, backend: str, diag: DiagnosticsConfig) -> None:
        self.owns_group = not dist.is_initialized()
        self.env: DistEnv = self._join(backend, diag) if self.owns_group else current_env()
        self.lock: OutLock | None = None
        self.resume_path: str | None = None
        self.saved: dict | None = None  # the checkpoint, until the loop's first batch restores it
        self.kept: KeptFiles | None = None  # its DCP files this rank hashed, until then too

    @staticmethod
    def _join(backend: str, diag: DiagnosticsConfig) -> DistEnv:
        """Join with the start-up timeout, then give collectives theirs: the backend's own timeout
        comes after the watchdog's report, which explains what the backend's error would not."""
        env = init_distributed(backend, timeout=timedelta(seconds=diag.startup_timeout))
        after = diag.collective_timeout + 120 if diag.collective_timeout else DEFAULT_TIMEOUT.total_seconds()
        set_collective_timeout(timedelta(seconds=after))
        return env

    def open(self, out: Path | None, cfg: CheckpointConfig, steps: int | None) -> None:
        """Take OUT's lock (rank 0) and decide, on every rank alike, whether and from where the run
        continues; the chosen checkpoint is loaded. Collective.

        A finished run that this command cannot train on (``resume.finished_here``: the same
        command, or a spent ``steps``) has nothing to do: rank 0 says so in one line, every rank
        leaves (the group, OUT's lock) and the process exits with 0 (``SystemExit``) here, before
        anything is written and before any code of the script's after this call runs."""
        self.lock = OutLock(out) if out is not None and self.env.is_rank0 else None
        self.resume_path, self.kept = resume.resume_point(out, cfg, self.env, self.lock)
        if out is not None:
            note_out(out)  # for the launcher's restart line: where a restart goes on from
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            if self.env.is_rank0 and self.resume_path is None and not restarted:
                (out / EVENTS).unlink(missing_ok=True)  # an earlier run's, started over
        self.saved = resume.load(self.resume_path, self.env.device) if self.resume_path else None
        line = resume.finished_here(out or self.resume_path, self.saved, steps, self.env)
        if line is not None:
            if self.env.is_rank0:
                print(line, flush=True)
            self.leave()
            raise SystemExit(0)

    def finished_run(self) -> dict | None:
        """The finished run's checkpoint another command resumed, until the loop's first batch
        restores it (a restarted worker's run failed after it was written: it finishes again)."""
        if self.saved is None or self.saved.get("finished") is None or self.env.restart_count > 0:
            return None
        return self.saved

    def saved_state(self, name: str) -> object | None:
        """The part ``name`` of the checkpoint the run continues from, before the loop restores it."""
        return self.saved["state"].get(name) if self.saved is not None else None

    def take_saved(self) -> tuple[str, dict, KeptFiles | None] | None:
        """The checkpoint to restore (path, contents, the files kept for its loads), once: the loop's
        first batch takes it."""
        saved, self.saved = self.saved, None
        kept, self.kept = self.kept, None
        return (self.resume_path, saved, kept) if saved is not None else None

    def leave(self) -> None:
        """Release OUT's lock and leave the process group the run created."""
        lock, self.lock = self.lock, None  # leaving twice (an error while leaving) does nothing
        self.kept = None  # a run closed before its first batch holds no checkpoint bytes
        if lock is not None:
            lock.release()
        if self.owns_group:
            self.owns_group = False
            destroy()
