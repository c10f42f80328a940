"""Hang attribution for unmodified scripts under ``ddpkit run``: the launcher's side.

A script that knows nothing of ddpkit announces no phases; what is known of each rank is what its
launcher sees from outside: the default group's collective sequence number (written by the
worker's sitecustomize), when it last changed, the CPU time the process used since, and its
process state. ``find_hang`` decides from that alone; ``format_report`` writes it out with every
rank's stacks. Pure functions over ``WorkerState``, tested without processes.

The rule. A collective completes only once every rank has issued it, so while some rank has
issued fewer collectives than the newest one, the ranks in the newest are waiting: when one of
them has waited ``timeout_s``, the job is hung and the ranks behind have not reached it. When all
ranks have issued the same number and none moved for ``timeout_s``, they are either all waiting
(a desync, a network fault) or all computing; only the first burns no CPU, so the job is hung
when every rank used under ``IDLE_CPU`` of a core since its last collective.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

IDLE_CPU = 0.1  # share of one core below which a rank that made no progress is waiting, not working
# Without --collective-timeout: this share of the script's own process-group timeout, so that the
# report comes before torch's timeout error, and nothing torch would let wait is ended.
AUTO_SHARE = 0.9
TORCH_DEFAULT_TIMEOUT_S = 1800.0  # gloo's, when a rank's group timeout could not be read
STALE_S = 15.0  # a launcher silent this long has lost its node, or the network to it


@dataclass(frozen=True)
class WorkerState:
    """One rank as its launcher sees it.

    Args:
        rank: global rank.
        world: world size the rank was started with.
        pid: its process id on ``host``.
        host: the host it runs on.
        seq: collectives it issued on the default group (-1: no process group yet).
        left: True once it destroyed its process group: it will issue nothing more.
        idle_s: seconds since ``seq`` last changed, when the launcher looked.
        cpu_s: CPU seconds the process used since ``seq`` last changed.
        proc: the process state: running, sleeping, stopped (SIGSTOP), exited.
        heard_wall: ``time.time()`` when the launcher looked.
        group_timeout_s: the timeout of its default process group (0: unknown).
    """

    rank: int
    world: int
    pid: int
    host: str
    seq: int
    left: bool
    idle_s: float
    cpu_s: float
    proc: str
    heard_wall: float
    group_timeout_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerState:
        return cls(**json.loads(text))

    def idle_at(self, now_wall: float) -> float:
        """Seconds without progress by ``now_wall``, counting the time since its launcher looked."""
        return self.idle_s + max(0.0, now_wall - self.heard_wall)

    def silent_s(self, now_wall: float) -> float:
        return max(0.0, now_wall - self.heard_wall)


def auto_timeout(states: Mapping[int, WorkerState]) -> float:
    """The collective timeout when none was given: ``AUTO_SHARE`` of the ranks' group timeout."""
    timeouts = [s.group_timeout_s for s in states.values() if s.group_timeout_s > 0]
    return AUTO_SHARE * (max(timeouts) if timeouts else TORCH_DEFAULT_TIMEOUT_S)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def find_hang(states: Mapping[int, WorkerState], world: int, timeout_s: float, now_wall: float) -> str | None:
    """The one-line attribution of a hang, or None while the job may still be making progress.

    Args:
        states: the latest state of each rank that has one.
        world: the world size.
        timeout_s: ``--collective-timeout``.
        now_wall: ``time.time()``.
    """
    grouped = {r: s for r, s in states.items() if s.seq >= 0}
    if not grouped:
        return None  # no process group yet: start-up is torch's timeout to enforce
    newest = max(s.seq for s in grouped.values())
    waiting = [s for s in grouped.values() if s.seq == newest and not s.left]
    behind = sorted(set(range(world)) - {s.rank for s in waiting})
    waited = [s for s in waiting if s.idle_at(now_wall) >= timeout_s]
    if behind and waited:
        longest = max(s.idle_at(now_wall) for s in waited)
        verb = "has" if len(behind) == 1 else "have"
        return (
            f"{_ranks(sorted(s.rank for s in waiting))} waited {longest:.0f} s in collective #{newest}; "
            f"{_ranks(behind)} {verb} not reached it"
        )
    if not behind and len(waited) == world and all(_blocked(s, now_wall) for s in waited):
        return (
            f"every rank issued collective #{newest} and none progressed for {timeout_s:g} s, using no CPU: "
            "they wait in it (different collectives on different ranks, or a network fault)"
        )
    return None


def _blocked(state: WorkerState, now_wall: float) -> bool:
    return state.cpu_s < IDLE_CPU * max(state.idle_at(now_wall), 1e-9)


def rank_line(rank: int, state: WorkerState | None, newest: int, now_wall: float) -> str:
    """Where one rank is, how long it has been idle, and whether it could be asked for its stack."""
    if state is None:
        return f"rank {rank}: never reported (its worker did not start, or its node's launcher is gone)"
    where = "no process group yet" if state.seq < 0 else f"issued #{state.seq}"
    if state.left:
        where += ", then destroyed its process group"
    elif state.proc.startswith("stopped"):
        where += " when last seen (a stopped process's count is up to one poll old)"
    elif 0 <= state.seq < newest:
        where += f", {newest - state.seq} behind"
    idle = state.idle_at(now_wall)
    line = f"rank {rank}: {where}; idle {idle:.1f} s, {state.cpu_s:.1f} s CPU since"
    line += f"; pid {state.pid} on {state.host}"
    silent = state.silent_s(now_wall)
    if silent > STALE_S:
        unreachable = f"its node, or the network to {state.host}, is unreachable"
        return f"{line}: not heard from for {silent:.0f} s: {unreachable}"
    return f"{line}: {state.proc}"


def format_report(
    summary: str,
    timeout_s: float,
    world: int,
    states: Mapping[int, WorkerState],
    stacks: Mapping[int, str],
    now_wall: float,
    source: str = "--collective-timeout",
) -> str:
    """The whole report: the attribution, one line per rank, then each rank's stacks.

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
    lines = [
        f"ddpkit hang report: a collective did not complete within {timeout_s:g} s ({source})",
        summary,
        "",
        "ranks:",
        *(f"  {rank_line(r, states.get(r), newest, now_wall)}" for r in range(world)),
    ]
    for rank in range(world):
        text = stacks.get(rank, "(no stack: the rank could not be asked)")
        lines += ["", f"stacks of rank {rank} (every thread, most recent call first):", text.rstrip("\n")]
    return "\n".join(lines) + "\n"
