"""Hang attribution for unmodified scripts under ``ddpkit run``: the launcher's rule.

A script that knows nothing of ddpkit announces no phases; what is known of each rank is what its
launcher sees from outside (``RankState.outside``): the default group's collective sequence
number (written by the worker's boot hook), when it last changed, the CPU time the process used
since, and its process state. ``find_hang`` decides from that alone, with the one attribution
(``hang_report.Attribution``); ``format_report`` is the one report with every thread's stacks.

The rule. While some rank has issued fewer collectives than the newest one, the ranks in the
newest are waiting: when one of them has waited ``timeout_s``, the job is hung and the ranks
behind have not reached it. When all ranks have issued the same number and none moved for
``timeout_s``, they are either all waiting (a desync, a network fault) or all computing; only the
first burns no CPU, so the job is hung when every rank used under ``IDLE_CPU`` of a core since
its last collective.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.diagnostics.hang_report import Attribution, Report, outside_line
from ddpkit.diagnostics.hang_state import RankState

IDLE_CPU = 0.1  # share of one core below which a rank that made no progress is waiting, not working
# Without --collective-timeout: this share of the script's own process-group timeout, so that the
# report comes before torch's timeout error, and nothing torch would let wait is ended.
AUTO_SHARE = 0.9
TORCH_DEFAULT_TIMEOUT_S = 1800.0  # gloo's, when a rank's group timeout could not be read
DUMP_STACKS = "stacks of rank {} (every thread, most recent call first):"  # faulthandler's dump
NOT_ASKED = "(no stack: the rank could not be asked)"

# The launcher's constructor of the one record (the name its callers and tests know).
WorkerState = RankState.from_outside


def auto_timeout(states: Mapping[int, RankState]) -> float:
    """The collective timeout when none was given: ``AUTO_SHARE`` of the ranks' group timeout."""
    timeouts = [s.group_timeout_s for s in states.values() if s.group_timeout_s > 0]
    return AUTO_SHARE * (max(timeouts) if timeouts else TORCH_DEFAULT_TIMEOUT_S)


def find_hang(states: Mapping[int, RankState], world: int, timeout_s: float, now_wall: float) -> str | None:
    """The one-line attribution of a hang, or None while the job may still be making progress.

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


def format_report(
    summary: str,
    timeout_s: float,
    world: int,
    states: Mapping[int, RankState],
    stacks: Mapping[int, str],
    now_wall: float,
    source: str = "--collective-timeout",
) -> str:
    """The launcher's report: the attribution, one line per rank, then each rank's stacks.

    Args:
        summary: ``find_hang``'s line.
        timeout_s: ``--collective-timeout``.
        world: the world size.
        states: each rank's state.
        stacks: each rank's faulthandler dump (all threads, most recent call first), or why none.
        now_wall: ``time.time()`` when the report was made.
        source: where ``timeout_s`` came from, for the first line.
    """
    newest = max((s.seq for s in states.values()), default=-1)
    return Report(
        headline=[f"a collective did not complete within {timeout_s:g} s ({source})"],
        attribution=[summary],
        rank_lines=[outside_line(r, states.get(r), now_wall, newest) for r in range(world)],
        stacks={r: stacks.get(r, NOT_ASKED) for r in range(world)},
        stack_title=DUMP_STACKS,
    ).text()
