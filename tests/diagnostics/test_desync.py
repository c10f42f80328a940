"""Desync detection: ranks blocked in different collectives are reported; a slow rank is not."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks

from ddpkit.diagnostics.hang import desync as desync_probe
from ddpkit.diagnostics.hang.desync import (
    Blocked,
    DesyncProbe,
    blocked_record,
    desync_line,
    find_desync,
    signature,
)
from ddpkit.diagnostics.hang.exchange import BoundedStore
from ddpkit.diagnostics.hang.record import RankState
from ddpkit.diagnostics.hang.report import format_report
from ddpkit.diagnostics.hang.stacks import user_frame
from ddpkit.diagnostics.hang.watchdog import HangWatchdog
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.launch import LaunchError


def _entry(seq: int, name: str, retired: bool = True, sizes=((5,),), dtype="Float") -> dict:
    """A flight-recorder entry as torch 2.13 records a gloo collective (state stays "scheduled")."""
    return {
        "collective_seq_id": seq,
        "profiling_name": name,
        "state": "scheduled",
        "retired": retired,
        "input_sizes": [list(s) for s in sizes],
        "input_dtypes": [dtype] * len(sizes),
    }


def _blocked(rank: int, seq: int, op: str, earlier: dict[int, str] | None = None) -> Blocked:
    return Blocked(rank, seq, op, {**(earlier or {}), seq: op}, where=f"train.py:{20 + rank} (line {rank})")


SAVE, GRAD = "gloo:all_gather", "gloo:all_reduce(5 Float)"  # run.save()'s RNG gather, DDP's all-reduce


# ---- the criterion and the report, without processes ----


def test_signature_keeps_shapes_only_where_every_rank_has_the_same():
    two = _entry(3, "gloo:all_reduce", sizes=((4, 3), (2,)))
    assert signature(two) == "gloo:all_reduce(4x3 Float, 2 Float)"
    assert signature(_entry(3, "gloo:broadcast", sizes=((),))) == "gloo:broadcast(scalar Float)"
    assert signature(_entry(3, "gloo:gather", sizes=((7,),))) == "gloo:gather"  # root and others differ


def test_a_rank_is_blocked_only_while_its_latest_collective_is_in_flight():
    done = [_entry(1, "gloo:barrier", sizes=()), _entry(2, "gloo:all_reduce")]
    assert blocked_record(done, rank=1) is None  # computing after a completed collective
    assert blocked_record([], rank=1) is None  # recorder off: never a desync
    record = blocked_record([*done, _entry(3, "gloo:all_gather", retired=False)], 1, "train.py:9", 5.0)
    assert record == Blocked(1, 3, SAVE, {1: "gloo:barrier", 2: GRAD, 3: SAVE}, "train.py:9", 5.0)
    assert Blocked.from_json(record.to_json()) == record  # sequence numbers survive JSON's string keys


def test_ranks_in_different_collectives_at_one_sequence_number_are_a_desync():
    records = {0: _blocked(0, 23, SAVE), 1: _blocked(1, 23, GRAD), 2: _blocked(2, 23, GRAD)}
    assert find_desync(records, world_size=3) == [records[0], records[1], records[2]]
    shapes = {0: _blocked(0, 9, "gloo:all_reduce(2 Double)"), 1: _blocked(1, 9, GRAD)}  # rank-0 metric
    assert find_desync(shapes, world_size=2) is not None


def test_a_rank_that_is_not_blocked_means_slow_not_desynchronized():
    # Rank 0 computes (its latest collective completed, so it published nothing); the others wait.
    assert find_desync({1: _blocked(1, 24, GRAD), 2: _blocked(2, 24, GRAD)}, world_size=3) is None


def test_ranks_in_the_same_collective_are_not_a_desync():
    assert find_desync({0: _blocked(0, 7, GRAD), 1: _blocked(1, 7, GRAD)}, world_size=2) is None


def test_ranks_apart_are_a_desync_only_where_their_records_differ():
    # Rank 1 issued the next bucket's all-reduce while rank 0 still waits in a slow one: agreed.
    ahead = _blocked(1, 8, GRAD, earlier={7: GRAD})
    assert find_desync({0: _blocked(0, 7, GRAD), 1: ahead}, world_size=2) is None
    # Rank 1 recorded an all-reduce at #7, where rank 0 waits in an all_gather: a desync.
    assert find_desync({0: _blocked(0, 7, SAVE), 1: ahead}, world_size=2) is not None
    # Rank 1 no longer remembers #7: no evidence, the collective timeout decides.
    assert find_desync({0: _blocked(0, 7, SAVE), 1: _blocked(1, 8, GRAD)}, world_size=2) is None


def test_the_desync_line_names_each_call_its_ranks_and_their_lines():
    records = [_blocked(0, 23, SAVE), _blocked(1, 23, GRAD), Blocked(2, 23, GRAD, {}, "train.py:21 (line 1)")]
    assert desync_line(records) == (
        "desync (a collective only some ranks called): rank 0 is in gloo:all_gather #23 at train.py:20 "
        "(line 0); ranks 1, 2 are in gloo:all_reduce(5 Float) #23 at train.py:21 (line 1)"
    )


def test_a_desync_report_starts_with_the_desync():
    states = {r: RankState(r, 23, 4, "checkpoint", progress_wall=100.0, op="gloo:all_gather") for r in (0, 1)}
    headline = ["desync (a collective only some ranks called): ...", "every rank has waited"]
    text = format_report(1, 1800, 2, states, {}, now_wall=140.0, headline=headline)
    assert text.startswith("ddpkit hang report: desync (a collective only some ranks called): ...\n")
    assert "every rank has waited\nevery rank has issued collective #23" in text
    assert "made no progress for 1800 s" not in text


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if line.endswith(marker))


def _waits_in_user_code(fake_torch: dict, parked: threading.Event, release: threading.Event) -> None:
    fake_torch["wait"](parked, release)  # USER LINE


def test_user_frame_is_the_innermost_frame_outside_ddpkit_torch_and_the_stdlib():
    fake_torch = {"__name__": "torch.distributed.fake"}
    code = "def wait(parked, release):\n    parked.set()\n    release.wait()\n"
    exec(compile(code, "c10d.py", "exec"), fake_torch)
    parked, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=_waits_in_user_code, args=(fake_torch, parked, release))
    thread.start()
    parked.wait()
    try:
        where = user_frame(thread.ident)
    finally:
        release.set()
        thread.join()
    assert where == f'{__file__}:{_line_of("# USER LINE")} (fake_torch["wait"](parked, release)  # USER LINE)'


def test_desync_s_defaults_to_30_and_rejects_negatives():
    assert HangWatchdog(DistEnv(), 1800, store=dist.HashStore()).desync_s == 30.0
    with pytest.raises(ConfigError, match="desync_timeout"):
        HangWatchdog(DistEnv(), 1800, store=dist.HashStore(), desync_s=-1)


# ---- the probe over a store, with a scripted flight recorder ----


@pytest.fixture
def recorder(monkeypatch):
    """The flight recorder each probe reads: ``recorder["entries"]``, with every dump counted."""
    state = {"entries": [], "dumps": 0}

    def dump(group_name: str) -> list[dict]:
        state["dumps"] += 1
        return list(state["entries"])

    monkeypatch.setattr(desync_probe, "flight_entries", dump)
    return state


def _probe(rank: int, store: BoundedStore) -> DesyncProbe:
    return DesyncProbe(rank, 2, "0", desync_s=30, check_s=3, store=store, main_ident=threading.get_ident())


def test_probe_costs_nothing_while_busy_and_one_dump_per_idle_period(recorder):
    store = BoundedStore(dist.HashStore())
    probe = _probe(0, store)
    recorder["entries"] = [_entry(5, "gloo:all_reduce")]  # completed: the rank computes
    for t in range(30):
        assert probe.tick(float(t), idle_s=t % 10, progressed=t % 10 == 0) is None
    assert recorder["dumps"] == 0  # never idle for desync_s: the recorder is not read
    for t in range(30, 300):
        assert probe.tick(float(t), idle_s=t - 30.0, progressed=t == 30) is None
    assert recorder["dumps"] == 1 and not store.call("check", ["blocked/0"])  # slow, so nothing published
    recorder["entries"].append(_entry(6, "gloo:all_reduce", retired=False))
    probe.tick(300.0, idle_s=0.0, progressed=True)
    probe.tick(330.0, idle_s=30.0, progressed=False)
    assert store.call("check", ["blocked/0"]) and Blocked.from_json(store.call("get", "record/0")).seq == 6
    probe.tick(331.0, idle_s=0.0, progressed=True)
    assert not store.call("check", ["blocked/0"])  # progress withdraws it
    store.close()


def test_probes_of_ranks_in_different_collectives_find_the_desync(recorder):
    store = BoundedStore(dist.HashStore())
    probes = [_probe(0, store), _probe(1, store)]
    history = [_entry(22, "gloo:all_gather", sizes=((5,),))]
    recorder["entries"] = [*history, _entry(23, "gloo:all_gather", retired=False, sizes=((1,),))]
    assert probes[0].tick(30.0, idle_s=30.0, progressed=False) is None  # rank 1 is not blocked yet
    recorder["entries"] = [*history, _entry(23, "gloo:all_reduce", retired=False)]
    found = probes[1].tick(31.0, idle_s=31.0, progressed=False)
    assert [(r.rank, r.seq, r.op) for r in found] == [(0, 23, SAVE), (1, 23, GRAD)]
    assert all(r.where.startswith(f"{__file__}:") for r in found)
    store.close()


# ---- real ranks over gloo ----

TIMEOUT_S, DESYNC_S = 60.0, 1.5  # the timeout is the backstop: a missed desync fails the test at 60 s


def _saves_on_rank_0_only(env: DistEnv, report: str, desync_s: float) -> None:
    with HangWatchdog(env, TIMEOUT_S, poll_s=0.2, report_path=report, desync_s=desync_s) as watchdog:
        watchdog.phase(1, "warm-up all_reduce")
        dist.all_reduce(torch.ones(1))
        watchdog.phase(2, "checkpoint on rank 0, gradients elsewhere")
        if env.rank == 0:
            dist.all_gather_object([None] * env.world_size, torch.get_rng_state())  # RANK 0'S SAVE
        else:
            dist.all_reduce(torch.ones(5))  # THE OTHERS' GRADIENTS


@pytest.mark.slow
def test_ranks_in_different_collectives_are_reported_as_a_desync(tmp_path):
    report, started = tmp_path / "hang.txt", time.monotonic()
    with pytest.raises(LaunchError, match=r"hang report: .*desync \(a collective only some") as failed:
        run_ranks(_saves_on_rank_0_only, 3, str(report), DESYNC_S)
    assert time.monotonic() - started < TIMEOUT_S  # named by the desync, not the timeout
    save, grads, line = _line_of("# RANK 0'S SAVE"), _line_of("# THE OTHERS' GRADIENTS"), str(failed.value)
    assert f"rank 0 is in gloo:all_gather #2 at {__file__}:{save} (dist.all_gather_object(" in line
    assert f"ranks 1, 2 are in gloo:all_reduce(5 Float) #2 at {__file__}:{grads} (" in line
    text = report.read_text()
    assert text.startswith("ddpkit hang report: desync (a collective only some ranks called): rank 0 is in")
    assert "every rank has waited over 1.5 s in its collective (desync_timeout)" in text
    assert all(f"stack of rank {r}" in text for r in range(3))


def _slow_rank_0(env: DistEnv, report: str) -> list[float]:
    with HangWatchdog(env, TIMEOUT_S, poll_s=0.1, report_path=report, desync_s=0.5) as watchdog:
        watchdog.phase(1, "warm-up all_reduce")
        dist.all_reduce(torch.ones(1))
        watchdog.phase(2, "gradient all_reduce")
        if env.rank == 0:
            time.sleep(4.0)  # 8 x desync_s of rank-0-only work, no collective: slow, not a desync
        total = torch.full((5,), float(env.rank))
        dist.all_reduce(total)  # rank 1 waits here all along, its latest collective in flight
    return total.tolist()


@pytest.mark.slow
def test_a_slow_rank_is_not_a_desync(tmp_path):
    report = tmp_path / "hang.txt"
    assert run_ranks(_slow_rank_0, 2, str(report)) == [[1.0] * 5] * 2
    assert not report.exists()
