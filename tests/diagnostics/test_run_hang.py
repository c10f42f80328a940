"""The launcher's hang rule for unmodified scripts, on hand-made states (no processes)."""

from __future__ import annotations

from ddpkit.diagnostics.hang.record import auto_timeout, find_hang
from ddpkit.diagnostics.hang.record import outside_state as WorkerState
from ddpkit.diagnostics.hang.report import format_run_report as format_report

NOW = 1000.0


def _state(rank: int, seq: int, idle: float, cpu: float = 0.0, **kw) -> WorkerState:
    values = dict(
        rank=rank, world=3, pid=100 + rank, host="h", seq=seq, left=False, idle_s=idle, cpu_s=cpu,
        proc="sleeping", heard_wall=NOW,
    )  # fmt: skip
    return WorkerState(**{**values, **kw})


def test_ranks_behind_the_newest_collective_are_named_once_one_waited_the_timeout():
    states = {0: _state(0, 7, 31), 1: _state(1, 6, 31, cpu=30), 2: _state(2, 7, 31)}
    expected = "ranks 0, 2 waited 31 s in collective #7; rank 1 has not reached it"
    assert find_hang(states, 3, 30, NOW) == expected
    assert find_hang(states, 3, 60, NOW) is None  # not yet


def test_level_ranks_hang_only_when_none_of_them_works():
    waiting = {r: _state(r, 7, 40, cpu=0.1) for r in range(3)}
    assert find_hang(waiting, 3, 30, NOW).startswith("every rank issued collective #7 and none progressed")
    working = {**waiting, 1: _state(1, 7, 40, cpu=39)}  # a long computation between collectives
    assert find_hang(working, 3, 30, NOW) is None


def test_a_rank_that_left_or_never_reported_is_behind():
    left = {0: _state(0, 7, 31), 1: _state(1, 7, 31, left=True), 2: _state(2, 7, 31)}
    assert find_hang(left, 3, 30, NOW).endswith("rank 1 has not reached it")
    missing = {0: _state(0, 7, 31), 2: _state(2, 7, 31)}
    assert find_hang(missing, 3, 30, NOW).endswith("rank 1 has not reached it")
    assert find_hang({r: _state(r, -1, 99) for r in range(3)}, 3, 30, NOW) is None  # still starting


def test_a_silent_launcher_counts_its_silence_and_is_called_unreachable():
    states = {0: _state(0, 7, 5, heard_wall=NOW - 30), 1: _state(1, 6, 5), 2: _state(2, 6, 5)}
    expected = "rank 0 waited 35 s in collective #7; ranks 1, 2 have not reached it"
    assert find_hang(states, 3, 30, NOW) == expected
    text = format_report("summary", 30, 3, states, {1: "Current thread ...\n"}, NOW)
    assert "rank 0: issued #7; idle 35.0 s" in text and "network to h, is unreachable" in text
    assert "rank 1: issued #6, 1 behind" in text and "(no stack: the rank could not be asked)" in text


def test_without_a_timeout_given_the_scripts_own_group_timeout_sets_it():
    assert auto_timeout({0: _state(0, 7, 1, group_timeout_s=600), 1: _state(1, 7, 1)}) == 540
    assert auto_timeout({0: _state(0, 7, 1)}) == 0.9 * 1800  # unknown: torch's default for gloo
