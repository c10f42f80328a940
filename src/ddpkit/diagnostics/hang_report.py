"""The hang report: which ranks have not reached which collective, and where every rank is.

Pure formatting over the states and stacks the reporter collected, so it is tested without processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ddpkit.diagnostics.hang_state import RankState

NO_ANSWER = "no answer: stopped (SIGSTOP), dead, or holding the GIL"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _collective(seq: int, states: list[RankState]) -> str:
    """``#7 (gloo:all_reduce; step 3, phase 'log: loss all_reduce')`` from the ranks inside it."""
    ops = sorted({s.op for s in states if s.op})
    where = sorted({(s.step, s.phase) for s in states})
    parts = ["/".join(ops) or "op unknown"] + [f"step {step}, phase {phase!r}" for step, phase in where]
    return f"#{seq} ({'; '.join(parts)})"


def attribute(states: Mapping[int, RankState], world_size: int) -> list[str]:
    """Which ranks wait in which collective, and which have not reached it.

    A rank's sequence number counts the collectives it has issued on the default group, so the
    ranks with the highest number wait in that collective and every rank below it has not reached
    it. When all ranks issued the same number of collectives, none is late: they are all stuck in
    or after it (the stacks tell which), and differing phases mean they called different
    collectives (a desync).

    Args:
        states: the latest state of every rank that published one.
        world_size: number of ranks in the job.
    """
    unknown = [r for r in range(world_size) if r not in states]
    lines = [f"{_ranks(unknown)} published no state (watchdog not started)"] if unknown else []
    if not states:
        return lines
    newest = max(s.seq for s in states.values())
    waiting = [states[r] for r in sorted(states) if states[r].seq == newest]
    behind = [states[r] for r in sorted(states) if states[r].seq < newest]
    return lines + (_late_ranks(newest, waiting, behind) if behind else _level_ranks(newest, waiting))


def _level_ranks(newest: int, states: list[RankState]) -> list[str]:
    lines = [f"every rank has issued collective {_collective(newest, states)}; none progressed since"]
    if len({(s.phase, s.op) for s in states}) > 1:
        lines.append("the ranks are in different phases: they called different collectives (a desync)")
    return lines


def _late_ranks(newest: int, waiting: list[RankState], behind: list[RankState]) -> list[str]:
    verb = "has" if len(behind) == 1 else "have"
    waits = "waits" if len(waiting) == 1 else "wait"
    lines = [
        f"{_ranks([s.rank for s in waiting])} {waits} in collective {_collective(newest, waiting)}; "
        f"{_ranks([s.rank for s in behind])} {verb} not reached it:"
    ]
    for s in behind:
        left = " (its watchdog was stopped: it left the watched loop)" if s.stopped else ""
        lines.append(
            f"  rank {s.rank} last issued #{s.seq}, {newest - s.seq} behind: "
            f"step {s.step}, phase {s.phase!r}{left}"
        )
    return lines


def summary_line(states: Mapping[int, RankState], world_size: int, answered: set[int]) -> str:
    """The attribution in one line, for the last line a launcher prints: who waits, who is behind,
    and who did not answer (the rank a reader should look at, rather than the reporter)."""
    line = "; ".join(text.rstrip(":") for text in attribute(states, world_size) if not text.startswith("  "))
    silent = [r for r in range(world_size) if r not in answered]
    if silent:
        line += f"; {_ranks(silent)} did not answer ({NO_ANSWER.split(': ', 1)[1]})"
    return line


def rank_line(state: RankState | None, rank: int, answered: bool, now_wall: float) -> str:
    """One line per rank: where it is, how long it has been idle, and whether it answered."""
    if state is None:
        return f"rank {rank}: no state published; {'answered' if answered else NO_ANSWER}"
    op = f" ({state.op})" if state.op else ""
    where = f"rank {rank}: issued #{state.seq}{op}, step {state.step}, phase {state.phase!r}"
    who = f"idle {state.idle_s(now_wall):.1f} s, pid {state.pid} on {state.host}"
    if answered:
        return f"{where}, {who}: answered"
    return f"{where}, {who}: {NO_ANSWER} (try: py-spy dump --pid {state.pid} on {state.host})"


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
    """The whole report, as text.

    Args:
        reporter: the rank writing the report.
        timeout_s: the collective timeout that expired.
        world_size: number of ranks in the job.
        states: each rank's state: fresh from its answer, else its last published heartbeat.
        stacks: the main thread's stack of each rank that answered.
        now_wall: ``time.time()`` when the report was made.
        alone: why only the reporter's own view could be gathered (the store did not answer);
            then no attribution is attempted and only the ranks in ``states`` are listed.
        headline: what the report is about, when not the timeout (a desync, ``desync.py``); its
            first line follows "ddpkit hang report: " as the report's first line.
        source: the setting that gave ``timeout_s``.
    """
    listed = sorted(states) if alone else range(world_size)
    timed_out = f"rank {reporter} made no progress for {timeout_s:g} s ({source})"
    first, *more = headline or [timed_out]
    lines = [
        f"ddpkit hang report: {first}",
        *more,
        *([alone] if alone else attribute(states, world_size)),
        "",
        "ranks:",
        *(f"  {rank_line(states.get(r), r, r in stacks, now_wall)}" for r in listed),
    ]
    for rank in sorted(stacks):
        lines += ["", f"stack of rank {rank} (main thread, innermost call last):", stacks[rank].rstrip("\n")]
    return "\n".join(lines) + "\n"
