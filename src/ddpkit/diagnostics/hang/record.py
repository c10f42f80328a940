"""The one record of a rank's progress, the one attribution over the records, and how each
collector decides that the job is stuck.

Both collectors fill ``RankState``: the watchdog thread inside a rank (``watchdog.py``, under
``ddpkit.Run`` and the Trainer) and the launcher from outside (``workers.py``, under
``ddpkit run`` for scripts that know nothing of ddpkit, from what the worker's boot hook writes).
Both note when a rank last changed with ``Progress``. A watchdog decides from its own rank's idle
time; the launcher, which sees every rank of its node from outside, with ``find_hang``.

The launcher's rule. While some rank has issued fewer collectives than the newest one, the ranks
in the newest are waiting: when one of them has waited ``timeout_s``, the job is hung and the
ranks behind have not reached it. When all ranks have issued the same number and none moved for
``timeout_s``, they are either all waiting (a desync, a network fault) or all computing; only the
first burns no CPU, so the job is hung when every rank used under ``IDLE_CPU`` of a core since
its last collective.

Kept free of threads, stores and text beyond one line, so the bookkeeping is tested on its own.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ddpkit.diagnostics.hang.timings import TIMINGS

IDLE_CPU = 0.1  # share of one core below which a rank that made no progress is waiting, not working


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
    """Tracks when a rank last made progress: its sequence number or its mark changed.

    Both collectors keep one per rank. Inside, the mark is the ``(step, phase)`` tuple the loop
    last set, compared by identity: every ``phase()`` call stores a new tuple, so announcing the
    same phase name at the next step still counts as progress. Outside there is no mark, and the
    process's CPU time at its last progress is kept (``cpu_s``): a rank that waits burns none.
    """

    def __init__(self, now: float, cpu_s: float = 0.0) -> None:
        self.seq = -1
        self.mark: object = None
        self.last_change = now  # time.monotonic() of the last change
        self.cpu_s = cpu_s  # the process's CPU seconds at the last change (outside)

    def observe(self, seq: int, mark: object, now: float, cpu_s: float = 0.0) -> bool:
        """Record what the rank is at now; True when that is progress since the last call.

        Args:
            seq: the default group's sequence number.
            mark: the ``(step, phase)`` tuple the training loop last set (None outside).
            now: ``time.monotonic()``.
            cpu_s: the process's CPU seconds so far (outside).
        """
        if seq == self.seq and mark is self.mark:
            return False
        self.seq, self.mark, self.last_change = seq, mark, now
        self.cpu_s = cpu_s
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


def outside_state(*, idle_s: float, heard_wall: float, **fields: Any) -> RankState:
    """The record a launcher makes: no progress for ``idle_s`` when it looked, at ``heard_wall``."""
    return RankState(progress_wall=heard_wall - idle_s, heard_wall=heard_wall, **fields)


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0, 2``."""
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclass(frozen=True)
class Attribution:
    """Who waits in the newest collective, and who has not reached it.

    A rank's sequence number counts the collectives it has issued on the default group, and a
    collective completes only once every rank has issued it. So the ranks at the highest number
    that are still in the loop wait in that collective, and every other rank has not reached it:
    one below it, one that left the loop, one with no process group yet.

    Args:
        newest: the highest sequence number (-1: no rank has a process group yet).
        waiting: the ranks at ``newest`` that have not left, by rank.
        behind: every other rank that has a state, by rank.
        unknown: the ranks with no state.
    """

    newest: int
    waiting: list[RankState]
    behind: list[RankState]
    unknown: list[int]

    @classmethod
    def of(cls, states: Mapping[int, RankState], world_size: int) -> Attribution:
        """Split the ranks into those waiting in the newest collective and those that have not reached it.

        Args:
            states: the latest state of every rank that has one.
            world_size: number of ranks in the job.
        """
        newest = max((s.seq for s in states.values() if s.seq >= 0), default=-1)
        ranks = sorted(states)
        waiting = [r for r in ranks if newest >= 0 and states[r].seq == newest and not states[r].left]
        behind = [states[r] for r in ranks if r not in waiting]
        unknown = [r for r in range(world_size) if r not in states]
        return cls(newest, [states[r] for r in waiting], behind, unknown)

    def late_line(self, late: Sequence[int], waited_s: float | None = None) -> str:
        """``ranks 0, 1 wait in collective #5 (...); rank 2 has not reached it``.

        Args:
            late: the ranks to name as not there (the launcher counts unknown ranks too).
            waited_s: the longest wait, when the collector measured it (``waited 31 s``).
        """
        wait = (
            ("waits" if len(self.waiting) == 1 else "wait")
            if waited_s is None
            else f"waited {waited_s:.0f} s"
        )
        verb = "has" if len(late) == 1 else "have"
        where = collective(self.newest, self.waiting)
        who = ranks_text(s.rank for s in self.waiting)
        return f"{who} {wait} in collective {where}; {ranks_text(late)} {verb} not reached it"


def collective(seq: int, states: Sequence[RankState]) -> str:
    """``#7 (gloo:all_reduce; step 3, phase 'log: loss all_reduce')`` from the ranks inside it; ``#7``
    when their collector knew neither (outside the process)."""
    if all(s.outside for s in states):
        return f"#{seq}"
    ops = sorted({s.op for s in states if s.op})
    where = sorted({(s.step, s.phase) for s in states})
    parts = ["/".join(ops) or "op unknown"] + [f"step {step}, phase {phase!r}" for step, phase in where]
    return f"#{seq} ({'; '.join(parts)})"


def find_hang(states: Mapping[int, RankState], world: int, timeout_s: float, now_wall: float) -> str | None:
    """The launcher's one-line attribution of a hang, or None while the job may still be making
    progress (the rule: the module docstring).

    Args:
        states: the latest state of each rank that has one.
        world: the world size.
        timeout_s: ``--collective-timeout``.
        now_wall: ``time.time()``.
    """
    found = Attribution.of(states, world)
    if found.newest < 0:
        return None  # no process group yet: start-up is torch's timeout to enforce
    late = sorted([s.rank for s in found.behind] + found.unknown)
    waited = [s.idle_s(now_wall) for s in found.waiting if s.idle_s(now_wall) >= timeout_s]
    if late and waited:
        return found.late_line(late, waited_s=max(waited))
    if not late and len(waited) == world and all(_blocked(s, now_wall) for s in found.waiting):
        return (
            f"every rank issued collective #{found.newest} and none progressed for {timeout_s:g} s, "
            "using no CPU: they wait in it (different collectives on different ranks, or a network fault)"
        )
    return None


def _blocked(state: RankState, now_wall: float) -> bool:
    return state.cpu_s < IDLE_CPU * max(state.idle_s(now_wall), 1e-9)


def auto_timeout(states: Mapping[int, RankState]) -> float:
    """The launcher's collective timeout when none was given: ``auto_share`` of the ranks' group timeout."""
    timeouts = [s.group_timeout_s for s in states.values() if s.group_timeout_s > 0]
    return TIMINGS.auto_share * (max(timeouts) if timeouts else TIMINGS.torch_default_timeout_s)
