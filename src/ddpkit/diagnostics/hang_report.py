"""The hang report: which ranks have not reached which collective, and where every rank is.

One attribution (``attribute``) and one report (``Report``) over the one record
(``hang_state.RankState``), whichever collector filled it: the watchdog thread inside each rank
(``hang.py``) or the launcher outside it (``launch/hang_monitor.py``, through ``run_hang.py``).
A rank's line shows what its collector could see: inside, its phase and whether it answered;
outside, the CPU it used and its process state. Pure formatting, tested without processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddpkit.diagnostics.hang_state import RankState

log = logging.getLogger(__name__)

NO_ANSWER = "no answer: stopped (SIGSTOP), dead, or holding the GIL"
THREAD_STACK = "stack of rank {} (main thread, innermost call last):"  # hang.py: thread_stack()
STALE_S = 15.0  # a launcher silent this long has lost its node, or the network to it


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


def inside_line(rank: int, state: RankState | None, now_wall: float, answered: bool) -> str:
    """A rank its watchdog published: where it is, how long it has been idle, whether it answered."""
    if state is None:
        return f"rank {rank}: no state published; {'answered' if answered else NO_ANSWER}"
    op = f" ({state.op})" if state.op else ""
    where = f"rank {rank}: issued #{state.seq}{op}, step {state.step}, phase {state.phase!r}"
    who = f"idle {state.idle_s(now_wall):.1f} s, pid {state.pid} on {state.host}"
    if answered:
        return f"{where}, {who}: answered"
    return f"{where}, {who}: {NO_ANSWER} (try: py-spy dump --pid {state.pid} on {state.host})"


def outside_line(rank: int, state: RankState | None, now_wall: float, newest: int) -> str:
    """A rank its launcher saw from outside: where it is, its idle time and CPU, its process state."""
    if state is None:
        return f"rank {rank}: never reported (its worker did not start, or its node's launcher is gone)"
    where = "no process group yet" if state.seq < 0 else f"issued #{state.seq}"
    if state.left:
        where += ", then destroyed its process group"
    elif state.proc.startswith("stopped"):
        where += " when last seen (a stopped process's count is up to one poll old)"
    elif 0 <= state.seq < newest:
        where += f", {newest - state.seq} behind"
    line = f"rank {rank}: {where}; idle {state.idle_s(now_wall):.1f} s, {state.cpu_s:.1f} s CPU since"
    line += f"; pid {state.pid} on {state.host}"
    if (silent := state.silent_s(now_wall)) > STALE_S:
        unreachable = f"its node, or the network to {state.host}, is unreachable"
        return f"{line}: not heard from for {silent:.0f} s: {unreachable}"
    return f"{line}: {state.proc}"


@dataclass(frozen=True)
class Report:
    """One hang report: a headline, the attribution, one line per rank, then the stacks.

    Args:
        headline: what the report is about; its first line follows "ddpkit hang report: ".
        attribution: who waits and who is behind, in lines.
        rank_lines: one line per rank listed.
        stacks: each rank's stack text, by rank (a rank that could not be asked has none).
        stack_title: the heading of a rank's stack, ``{}`` for the rank: it says which threads
            the stack collector dumped and in which order.
    """

    headline: Sequence[str]
    attribution: Sequence[str]
    rank_lines: Sequence[str]
    stacks: Mapping[int, str]
    stack_title: str = THREAD_STACK

    def text(self) -> str:
        first, *more = self.headline
        lines = [f"ddpkit hang report: {first}", *more, *self.attribution, "", "ranks:"]
        lines += [f"  {line}" for line in self.rank_lines]
        for rank in sorted(self.stacks):
            lines += ["", self.stack_title.format(rank), self.stacks[rank].rstrip("\n")]
        return "\n".join(lines) + "\n"


def attribute(states: Mapping[int, RankState], world_size: int) -> list[str]:
    """The attribution as the watchdog's report shows it: the late ranks with their phase, or the
    ranks all level (then differing phases mean they called different collectives: a desync).

    Args:
        states: the latest state of every rank that published one.
        world_size: number of ranks in the job.
    """
    found = Attribution.of(states, world_size)
    lines = (
        [f"{ranks_text(found.unknown)} published no state (watchdog not started)"] if found.unknown else []
    )
    if not states:
        return lines
    if not (found.waiting and found.behind):
        level = found.waiting or found.behind
        lines.append(
            f"every rank has issued collective {collective(found.newest, level)}; none progressed since"
        )
        if len({(s.phase, s.op) for s in level}) > 1:
            lines.append("the ranks are in different phases: they called different collectives (a desync)")
        return lines
    lines.append(found.late_line([s.rank for s in found.behind]) + ":")
    for s in found.behind:
        left = " (its watchdog was stopped: it left the watched loop)" if s.left else ""
        where = f"step {s.step}, phase {s.phase!r}{left}"
        lines.append(f"  rank {s.rank} last issued #{s.seq}, {found.newest - s.seq} behind: {where}")
    return lines


def summary_line(states: Mapping[int, RankState], world_size: int, answered: set[int]) -> str:
    """The attribution in one line, for the last line a launcher prints: who waits, who is behind,
    and who did not answer (the rank a reader should look at, rather than the reporter)."""
    lines = attribute(states, world_size)
    line = "; ".join(text.rstrip(":") for text in lines if not text.startswith("  "))
    silent = [r for r in range(world_size) if r not in answered]
    if silent:
        line += f"; {ranks_text(silent)} did not answer ({NO_ANSWER.split(': ', 1)[1]})"
    return line


def format_report(
    reporter: int,
    timeout_s: float,
    world_size: int,
    states: Mapping[int, RankState],
    stacks: Mapping[int, str],
    now_wall: float,
    alone: str = "",
    headline: Sequence[str] = (),
    source: str = "--collective-timeout",
) -> str:
    """The watchdog's report, as text.

    Args:
        reporter: the rank writing the report.
        timeout_s: the collective timeout that expired.
        world_size: number of ranks in the job.
        states: each rank's state: fresh from its answer, else its last published heartbeat.
        stacks: the main thread's stack of each rank that answered.
        now_wall: ``time.time()`` when the report was made.
        alone: why only the reporter's own view could be gathered (the store did not answer);
            then no attribution is attempted and only the ranks in ``states`` are listed.
        headline: what the report is about, when not the timeout (a desync, ``desync.py``).
        source: the setting that gave ``timeout_s``.
    """
    listed = sorted(states) if alone else range(world_size)
    timed_out = f"rank {reporter} made no progress for {timeout_s:g} s ({source})"
    return Report(
        headline=headline or [timed_out],
        attribution=[alone] if alone else attribute(states, world_size),
        rank_lines=[inside_line(r, states.get(r), now_wall, r in stacks) for r in listed],
        stacks=stacks,
    ).text()


def write_report(path: Path, text: str) -> None:
    """``text`` to ``path`` through a temporary file and a rename; a failure is logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        log.error("could not write the hang report to %s: %s", path, exc)
