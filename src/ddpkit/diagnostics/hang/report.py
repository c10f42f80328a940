"""The hang report: which ranks have not reached which collective, and where every rank is.

One report (``report_text``) over the one record and the one attribution (``record.py``), whichever
collector filled the record; a rank's line shows what its collector could see (``rank_line``).
Pure formatting, tested without processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ddpkit.diagnostics.hang.record import Attribution, RankState, collective, ranks_text
from ddpkit.diagnostics.hang.timings import TIMINGS

log = logging.getLogger(__name__)

NO_ANSWER = "no answer: stopped (SIGSTOP), dead, or holding the GIL"
NO_STATE = "never reported (not started, or its node's launcher is gone)"
THREAD_STACK = "stack of rank {} (main thread, innermost call last):"  # stacks.thread_stack()
DUMP_STACKS = "stacks of rank {} (every thread, most recent call first):"  # faulthandler's dump
NOT_ASKED = "(no stack: the rank could not be asked)"


def rank_line(rank: int, state: RankState | None, now_wall: float, newest: int, answered: bool) -> str:
    """One rank's line, in the words its collector could see (``state.outside`` tells which).

    Inside: where it is, its phase, how long it has been idle and whether it answered. Outside:
    where it is, its idle time and the CPU it used since, and its process state.

    Args:
        rank: the rank.
        state: its state; None when it never reported.
        now_wall: ``time.time()`` when the report was made.
        newest: the highest sequence number any rank issued.
        answered: whether it answered the reporter with its stack (inside).
    """
    if state is None:
        return f"rank {rank}: {NO_STATE}"
    where = "no process group yet" if state.seq < 0 else f"issued #{state.seq}"
    idle = f"idle {state.idle_s(now_wall):.1f} s"
    who = f"pid {state.pid} on {state.host}"
    if state.outside:
        line = f"rank {rank}: {where}{_outside_where(state, newest)}; {idle}, {state.cpu_s:.1f} s CPU since"
        return f"{line}; {who}: {_outside_process(state, now_wall)}"
    op = f" ({state.op})" if state.op else ""
    line = f"rank {rank}: {where}{op}, step {state.step}, phase {state.phase!r}, {idle}, {who}"
    if answered:
        return f"{line}: answered"
    return f"{line}: {NO_ANSWER} (try: py-spy dump --pid {state.pid} on {state.host})"


def _outside_where(state: RankState, newest: int) -> str:
    if state.left:
        return ", then destroyed its process group"
    if state.proc.startswith("stopped"):
        return " when last seen (a stopped process's count is up to one poll old)"
    return f", {newest - state.seq} behind" if 0 <= state.seq < newest else ""


def _outside_process(state: RankState, now_wall: float) -> str:
    if (silent := state.silent_s(now_wall)) > TIMINGS.stale_s:
        return f"not heard from for {silent:.0f} s: its node, or the network to {state.host}, is unreachable"
    return state.proc


def report_text(
    headline: Sequence[str],
    attribution: Sequence[str],
    states: Mapping[int, RankState | None],
    stacks: Mapping[int, str],
    now_wall: float,
) -> str:
    """One hang report: a headline, the attribution, one line per rank, then the stacks.

    Args:
        headline: what the report is about; its first line follows "ddpkit hang report: ".
        attribution: who waits and who is behind, in lines.
        states: the state of each rank listed, by rank (None: it never reported).
        stacks: each rank's stack text, by rank. Inside, the ranks that answered; outside, every
            listed rank gets faulthandler's dump of every thread, or why there is none.
        now_wall: ``time.time()`` when the report was made.
    """
    known = [s for s in states.values() if s is not None]
    newest = max((s.seq for s in known), default=-1)
    outside = any(s.outside for s in known)
    first, *more = headline
    lines = [f"ddpkit hang report: {first}", *more, *attribution, "", "ranks:"]
    for rank, state in sorted(states.items()):
        lines.append(f"  {rank_line(rank, state, now_wall, newest, rank in stacks)}")
    shown = {r: stacks.get(r, NOT_ASKED) for r in states} if outside else stacks
    for rank in sorted(shown):
        title = (DUMP_STACKS if outside else THREAD_STACK).format(rank)
        lines += ["", title, shown[rank].rstrip("\n")]
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
    return report_text(
        headline=headline or [timed_out],
        attribution=[alone] if alone else attribute(states, world_size),
        states={r: states.get(r) for r in listed},
        stacks=stacks,
        now_wall=now_wall,
    )


def format_run_report(
    summary: str,
    timeout_s: float,
    world: int,
    states: Mapping[int, RankState],
    stacks: Mapping[int, str],
    now_wall: float,
    source: str = "--collective-timeout",
) -> str:
    """The launcher's report, as text: ``format_report``'s arguments, but ``find_hang``'s line
    (``summary``) is the attribution and ``stacks`` are faulthandler's dumps (or why none)."""
    return report_text(
        headline=[f"a collective did not complete within {timeout_s:g} s ({source})"],
        attribution=[summary],
        states={r: states.get(r) for r in range(world)},
        stacks=stacks,
        now_wall=now_wall,
    )


def write_report(path: Path, text: str) -> None:
    """``text`` to ``path`` through a temporary file and a rename; a failure is logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        log.error("could not write the hang report to %s: %s", path, exc)
