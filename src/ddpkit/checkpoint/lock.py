"""One run per output folder: an exclusive ``flock`` on OUT/.ddpkit.lock, held while the run lives.

The kernel drops the lock when the holding process dies however it dies (SIGKILL included), so a
stale lock never blocks the next run; while the holder lives, a second run on the same folder
fails at once with one line naming the holder. A forked child (a DataLoader worker) would share
the lock and could outlive a killed holder by seconds, so children close their copy at fork.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from ddpkit.errors import ConfigError

LOCK_NAME = ".ddpkit.lock"


class OutLock:
    """The lock on one run folder.

    Args:
        out: the run's folder; created if missing.
    """

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> OutLock:
        """Take the lock, or raise ConfigError naming the process that holds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a file in the way, a parent that cannot be made, no permission
            raise ConfigError(
                f"out={str(self.path.parent)!r} cannot be the run's folder ({exc.strerror}: "
                f"{exc.filename}); choose a folder path you can write to"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(
                f"{str(self.path.parent)!r} is in use by a running ddpkit run ({holder}); wait for it "
                "to end, or choose another output folder"
            ) from None
        os.register_at_fork(after_in_child=self._forget)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since {time.ctime()}\n".encode(), 0)
        self._fd = fd
        return self

    def _forget(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the child's copy only: the parent keeps the lock
            self._fd = None

    def release(self) -> None:
        """Let go of the lock (closing the file releases it); safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def check_not_running(out: Path) -> None:
    """Raise ConfigError if a live run holds ``out`` (before deleting or replacing it)."""
    if (Path(out) / LOCK_NAME).exists():
        OutLock(out).acquire().release()
