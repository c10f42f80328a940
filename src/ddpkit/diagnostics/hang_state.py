"""The one record of a rank's progress, and how a rank inside the process decides it is stuck.

Both collectors fill ``RankState``: the watchdog thread inside a rank (``hang.py``, under
``ddpkit.Run`` and the Trainer) and the launcher from outside (``launch/workerview.py``, under
``ddpkit run`` for scripts that know nothing of ddpkit, from what the worker's boot hook writes).
Kept free of threads and stores so the bookkeeping can be tested on its own.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RankState:
    """One rank's progress, as its collector saw it; the report and the attribution read only this.

    Inside, the rank knows its phase and the op it waits in; outside, the launcher knows the CPU
    the rank used and its process state. What a collector cannot see keeps its default.

    Args:
        rank: global rank.
        seq: collectives this rank has issued on the default group (-1: no process group yet).
        step: the training step it last announced with ``HangWatchdog.phase`` (0 outside).
        phase: the phase it last announced, e.g. ``"backward: gradient all-reduce"`` ("" outside).
        progress_wall: wall-clock time (``time.time()``) of its last progress.
        pid: its process id, for ``py-spy dump --pid`` or ``kill -CONT``.
        host: the host it runs on.
        op: the collective it waits in (from torch's flight recorder), or "" when unknown.
        left: True once it left the watched loop (its watchdog stopped, or it destroyed its
            process group): it will issue nothing more.
        world: the world size it was started with (0: unknown).
        cpu_s: CPU seconds it used since its last progress (outside only).
        proc: its process state: running, sleeping, stopped (SIGSTOP), exited ("" inside).
        heard_wall: ``time.time()`` when the launcher last read it (0: it published itself).
        group_timeout_s: the timeout of its default process group (0: unknown).
    """

    rank: int
    seq: int
    step: int = 0
    phase: str = ""
    progress_wall: float = 0.0
    pid: int = 0
    host: str = ""
    op: str = ""
    left: bool = False
    world: int = 0
    cpu_s: float = 0.0
    proc: str = ""
    heard_wall: float = 0.0
    group_timeout_s: float = 0.0

    @classmethod
    def from_outside(cls, *, idle_s: float, heard_wall: float, **fields: Any) -> RankState:
        """The record a launcher makes: no progress for ``idle_s`` when it looked, at ``heard_wall``."""
        return cls(progress_wall=heard_wall - idle_s, heard_wall=heard_wall, **fields)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankState:
        return cls(**json.loads(text))

    @property
    def outside(self) -> bool:
        """True when the launcher collected it (a script with no watchdog), not the rank itself."""
        return self.heard_wall > 0

    def idle_s(self, now_wall: float) -> float:
        """Seconds since its last progress (clocks of different hosts may differ a little)."""
        return max(0.0, now_wall - self.progress_wall)

    def silent_s(self, now_wall: float) -> float:
        """Seconds since the launcher last read it: a silent launcher has lost its node."""
        return max(0.0, now_wall - self.heard_wall) if self.outside else 0.0


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

    def state(self, rank: int, now: float, *, left: bool = False) -> RankState:
        """The state to publish, with the last progress converted to wall-clock time."""
        step, phase = self.mark if isinstance(self.mark, tuple) else (0, "not started")
        return RankState(
            rank=rank,
            seq=max(self.seq, 0),
            step=step,
            phase=phase,
            progress_wall=time.time() - self.idle(now),
            pid=os.getpid(),
            host=socket.gethostname(),
            left=left,
        )
