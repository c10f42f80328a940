"""What each rank tells the others about its progress, and how a rank decides it is stuck.

Kept free of threads and stores so the bookkeeping can be tested on its own; ``hang.py`` runs it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class RankState:
    """One rank's progress, as published in the rendezvous store.

    Args:
        rank: global rank.
        seq: collectives this rank has issued on the default group (its sequence number).
        step: the training step it last announced with ``HangWatchdog.phase``.
        phase: the phase it last announced, e.g. ``"backward: gradient all-reduce"``.
        progress_wall: wall-clock time (``time.time()``) of its last progress.
        pid: its process id, for ``py-spy dump --pid`` or ``kill -CONT``.
        host: the host it runs on.
        op: the collective it waits in (from torch's flight recorder), or "" when unknown.
        stopped: True once its watchdog was stopped: it left the watched loop.
    """

    rank: int
    seq: int
    step: int
    phase: str
    progress_wall: float
    pid: int = 0
    host: str = ""
    op: str = ""
    stopped: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankState:
        return cls(**json.loads(text))

    def idle_s(self, now_wall: float) -> float:
        """Seconds since its last progress (clocks of different hosts may differ a little)."""
        return max(0.0, now_wall - self.progress_wall)

    def with_op(self, op: str) -> RankState:
        return replace(self, op=op)


def this_process() -> tuple[int, str]:
    """(pid, host) of the calling process."""
    return os.getpid(), socket.gethostname()


class Progress:
    """Tracks when a rank last made progress: its sequence number or its phase changed.

    The phase is compared by identity: every ``phase()`` call stores a new tuple, so announcing the
    same phase name at the next step still counts as progress.
    """

    def __init__(self, now: float) -> None:
        self.seq = -1
        self.mark: object = None
        self.last_change = now  # time.monotonic() of the last change

    def observe(self, seq: int, mark: object, now: float) -> bool:
        """Record what the rank is at now; True when that is progress since the last call.

        Args:
            seq: the default group's sequence number.
            mark: the ``(step, phase)`` tuple the training loop last set.
            now: ``time.monotonic()``.
        """
        if seq == self.seq and mark is self.mark:
            return False
        self.seq, self.mark, self.last_change = seq, mark, now
        return True

    def idle(self, now: float) -> float:
        """Seconds without progress, by ``time.monotonic()``."""
        return now - self.last_change

    def state(self, rank: int, now: float, *, stopped: bool = False) -> RankState:
        """The state to publish, with the last progress converted to wall-clock time."""
        step, phase = self.mark if isinstance(self.mark, tuple) else (0, "not started")
        pid, host = this_process()
        return RankState(
            rank=rank,
            seq=max(self.seq, 0),
            step=step,
            phase=phase,
            progress_wall=time.time() - self.idle(now),
            pid=pid,
            host=host,
            stopped=stopped,
        )
