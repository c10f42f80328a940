"""Hang attribution: a late or frozen rank is named, stacks are shown, and no process is left behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import run_ranks

import ddpkit
from ddpkit.diagnostics.exit_codes import HANG_EXIT_CODE
from ddpkit.diagnostics.hang.record import Progress, RankState
from ddpkit.diagnostics.hang.report import attribute, format_report, summary_line
from ddpkit.diagnostics.hang.stacks import thread_stack
from ddpkit.diagnostics.hang.watchdog import HangWatchdog
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.launch import LaunchError
from ddpkit.launch.ports import free_port

TIMEOUT_S, POLL_S = 2.0, 0.2


def _state(rank: int, seq: int, phase="log: loss all_reduce", op="gloo:all_reduce") -> RankState:
    return RankState(rank, seq, step=3, phase=phase, progress_wall=100.0, pid=10 + rank, host="node1", op=op)


# ---- bookkeeping and report, without processes ----


def _mark(step: int, name: str) -> tuple[int, str]:
    return (step, name)  # a new tuple per call, as HangWatchdog.phase() stores


def test_progress_is_a_new_sequence_number_or_a_new_phase_call():
    progress, mark = Progress(now=0.0), _mark(1, "forward")
    assert progress.observe(0, mark, now=1.0)
    assert not progress.observe(0, mark, now=5.0)
    assert progress.idle(now=5.0) == 4.0
    assert progress.observe(1, mark, now=6.0)  # a collective was issued
    assert progress.observe(1, _mark(1, "forward"), now=7.0)  # phase() again, same name: progress
    assert progress.idle(now=7.5) == 0.5
    state = progress.state(rank=2, now=7.5)
    assert (state.rank, state.seq, state.step, state.phase, state.pid) == (2, 1, 1, "forward", os.getpid())
    assert RankState.from_json(state.to_json()) == state


def test_attribution_names_the_ranks_that_have_not_reached_the_collective():
    lines = attribute({0: _state(0, 5), 1: _state(1, 5), 2: _state(2, 4, "forward", op="")}, world_size=4)
    text = "\n".join(lines)
    assert "rank 3 published no state (watchdog not started)" in text
    assert "ranks 0, 1 wait in collective #5 (gloo:all_reduce; step 3, phase 'log: loss all_reduce')" in text
    assert "rank 2 has not reached it" in text
    assert "rank 2 last issued #4, 1 behind: step 3, phase 'forward'" in text


def test_the_summary_line_names_the_late_rank_not_the_reporter():
    states = {0: _state(0, 5), 1: _state(1, 4, "forward", op="")}
    line = summary_line(states, world_size=2, answered={0})
    assert line == (
        "rank 0 waits in collective #5 (gloo:all_reduce; step 3, phase 'log: loss all_reduce'); rank 1 has "
        "not reached it; rank 1 did not answer (stopped (SIGSTOP), dead, or holding the GIL)"
    )


def test_attribution_without_a_late_rank_points_at_a_desync():
    states = {0: _state(0, 5), 1: _state(1, 5, "checkpoint: rng all_gather_object", "gloo:all_gather")}
    text = "\n".join(attribute(states, world_size=2))
    assert "every rank has issued collective #5" in text
    assert "different collectives (a desync)" in text


def test_report_shows_stacks_of_ranks_that_answered_and_flags_the_silent_ones():
    states = {0: _state(0, 5), 1: _state(1, 5), 2: _state(2, 4, "forward", op="")}
    stacks = {0: '  File "train.py", line 9, in step\n', 1: '  File "train.py", line 9, in step\n'}
    text = format_report(1, 3.0, 3, states, stacks, now_wall=104.0)
    assert text.startswith("ddpkit hang report: rank 1 made no progress for 3 s (--collective-timeout)")
    assert "rank 0: issued #5 (gloo:all_reduce), step 3, phase 'log: loss all_reduce', idle 4.0 s" in text
    assert "rank 2: issued #4, step 3, phase 'forward', idle 4.0 s, pid 12 on node1: no answer" in text
    assert "py-spy dump --pid 12 on node1" in text
    assert "stack of rank 0" in text and "stack of rank 1" in text and "stack of rank 2" not in text


def test_thread_stack_shows_where_another_thread_waits():
    parked, release = threading.Event(), threading.Event()

    def _parked_in_collective():
        parked.set()
        release.wait()

    thread = threading.Thread(target=_parked_in_collective)
    thread.start()
    parked.wait()
    try:
        assert "in _parked_in_collective" in thread_stack(thread.ident)
    finally:
        release.set()
        thread.join()
    assert thread_stack(thread.ident) == "(thread has ended)\n"


@pytest.mark.parametrize("timeout_s, poll_s", [(0, 0.1), (-1, 0.1), (2.0, 0.0), (2.0, 2.0)])
def test_bad_timeouts_are_config_errors(timeout_s, poll_s):
    with pytest.raises(ConfigError):
        HangWatchdog(DistEnv(), timeout_s, poll_s=poll_s, store=dist.HashStore())


class _Recording(HangWatchdog):
    """A watchdog whose exit ends only its own thread, and is recorded."""

    follow_s = 0.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.exits: list[int] = []

    def _exit(self, code: int) -> None:
        self.exits.append(code)
        self._stop.set()  # ends the watchdog thread, not the test process


def _wait_until(done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture
def world_of_one(monkeypatch):
    """A gloo process group of one rank in the test process, destroyed afterwards."""
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()  # init_distributed sets it for the process
    yield ddpkit.init_distributed("gloo")
    ddpkit.destroy()
    torch.set_num_threads(threads)


def test_world_of_one_reports_a_stall_in_process(world_of_one, tmp_path):
    report = tmp_path / "hang.txt"
    with _Recording(world_of_one, 0.5, poll_s=0.05, report_path=report) as watchdog:
        watchdog.phase(1, "log: loss all_reduce")
        dist.all_reduce(torch.ones(1))
        watchdog.phase(2, "data: next batch")
        _wait_until(lambda: watchdog.exits, 10)  # the stall the watchdog reports
    assert watchdog.exits == [HANG_EXIT_CODE]
    text = report.read_text()
    assert "rank 0: issued #1 (gloo:all_reduce), step 2, phase 'data: next batch'" in text
    assert "in test_world_of_one_reports_a_stall_in_process" in text


def test_start_up_has_its_own_timeout_until_the_first_step_ends(world_of_one, tmp_path):
    # DDP's constructor under load once took longer than a 3 s --collective-timeout: the watchdog
    # reported a hang at step 0. Until steady(), the longer startup_s applies.
    report = tmp_path / "hang.txt"
    with _Recording(world_of_one, 0.3, poll_s=0.05, report_path=report, startup_s=60) as watchdog:
        time.sleep(0.9)  # three collective timeouts, well within start-up's
        assert watchdog.exits == [] and watchdog.limit_s == 60
        watchdog.phase(1, "forward/backward: gradient all-reduce")
        watchdog.steady()
        _wait_until(lambda: watchdog.exits, 10)
    assert watchdog.exits == [HANG_EXIT_CODE] and watchdog.limit_s == 0.3
    assert report.read_text().startswith(
        "ddpkit hang report: rank 0 made no progress for 0.3 s (--collective-timeout)"
    )


def test_a_hang_in_start_up_names_the_start_up_timeout(world_of_one, tmp_path):
    report = tmp_path / "hang.txt"
    with _Recording(world_of_one, 0.2, poll_s=0.05, report_path=report, startup_s=0.5) as watchdog:
        _wait_until(lambda: watchdog.exits, 10)
    first = report.read_text().splitlines()[0]
    assert first == (
        "ddpkit hang report: rank 0 made no progress for 0.5 s "
        "(startup_timeout: the first step had not ended)"
    )


def test_destroying_the_group_ends_watching_without_a_report(world_of_one):
    watchdog = _Recording(world_of_one, 0.3, poll_s=0.05).start()
    ddpkit.destroy()
    time.sleep(0.6)  # twice the timeout, with no progress
    assert watchdog.exits == []
    assert not any(t.name == "ddpkit-hang-watchdog" for t in threading.enumerate())
    watchdog.stop()


class _InProcess(_Recording):
    """Three ranks in one process: the test sets each one's sequence number, and can freeze it."""

    def __init__(self, *args, seq: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seq, self.frozen, self.thaw = seq, threading.Event(), threading.Event()

    def _sequence_number(self) -> int:
        return self.seq

    def _tick(self, now: float) -> None:
        if self.frozen.is_set():
            self.thaw.wait()  # like SIGSTOP: this thread neither publishes nor answers
            return
        super()._tick(now)


def _wait_in_collective(watchdog: HangWatchdog, step: int, released: threading.Event) -> None:
    watchdog.start()
    watchdog.phase(step, "gradient all_reduce")
    released.wait()


def _published_step(store: dist.Store, rank: int) -> int | None:
    key = f"ddpkit/hang/state/{rank}"
    return RankState.from_json(store.get(key)).step if store.check([key]) else None


def test_one_rank_reports_the_frozen_one_in_process(tmp_path, capfd):
    store, released, report = dist.HashStore(), threading.Event(), tmp_path / "hang.txt"
    dogs = [
        _InProcess(DistEnv(r, r, 3, 3), 0.5, poll_s=0.05, report_path=report, store=store, seq=2 - (r == 2))
        for r in range(3)
    ]
    threads = [threading.Thread(target=_wait_in_collective, args=(dog, 2, released)) for dog in dogs]
    for thread in threads:
        thread.start()
    _wait_until(lambda: _published_step(store, 2) == 2, 5)
    dogs[2].frozen.set()
    _wait_until(lambda: dogs[0].exits and dogs[1].exits, 20)
    released.set()
    dogs[2].thaw.set()
    for dog, thread in zip(dogs, threads, strict=True):
        thread.join()
        dog.stop()
    assert dogs[0].exits == dogs[1].exits == [HANG_EXIT_CODE] and dogs[2].exits == []
    text = report.read_text()
    assert "ranks 0, 1 wait in collective #2 (op unknown; step 2, phase 'gradient all_reduce')" in text
    assert "rank 2 last issued #1, 1 behind" in text
    assert "rank 2: issued #1, step 2, phase 'gradient all_reduce'" in text and "no answer" in text
    assert text.count("in _wait_in_collective") == 2 and "stack of rank 2" not in text
    assert capfd.readouterr().err.count("ddpkit hang report") == 1


# ---- real ranks over gloo ----


def _one_rank_late(env: DistEnv, report: str, late: int, freeze: bool, entered: str = "") -> None:
    with HangWatchdog(env, TIMEOUT_S, poll_s=POLL_S, report_path=report) as watchdog:
        watchdog.phase(1, "warm-up all_reduce")
        dist.all_reduce(torch.ones(1))
        watchdog.phase(2, "gradient all_reduce")
        if env.rank == late:
            time.sleep(3 * POLL_S)  # lets its heartbeat publish step 2
            if freeze:
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(60)  # far past the timeout: only the watchdog can end this job early
        if entered:
            with open(entered, "a") as f:
                f.write(f"{time.time()}\n")
        dist.all_reduce(torch.ones(1))


@pytest.mark.slow
def test_late_rank_is_named_and_every_stack_is_shown(tmp_path):
    report, entered = tmp_path / "hang.txt", tmp_path / "entered"
    # The launcher's line names the late rank and the report (from the reporter's store key), not
    # only the reporter's exit code.
    blame = f"exited with code {HANG_EXIT_CODE}, after a hang report: .*rank 2 has not reached it; .*{report}"
    with pytest.raises(LaunchError, match=blame):
        run_ranks(_one_rank_late, 3, str(report), 2, False, str(entered))
    waited = time.time() - min(float(t) for t in entered.read_text().split())
    assert waited < TIMEOUT_S + 15, f"the job ran {waited:.0f} s after ranks 0 and 1 entered the all_reduce"
    text = report.read_text()
    assert "ranks 0, 1 wait in collective #2 (gloo:all_reduce; step 2, phase 'gradient all_reduce')" in text
    assert "rank 2 has not reached it" in text and "rank 2 last issued #1, 1 behind" in text
    by_rank = {int(part.split()[0]): part for part in text.split("\nstack of rank ")[1:]}
    assert sorted(by_rank) == [0, 1, 2]
    assert "time.sleep(60)" in by_rank[2] and "in all_reduce" not in by_rank[2]
    assert all("in all_reduce" in by_rank[r] for r in (0, 1))


def _frozen_rank(rank: int, port: int, frozen: int, report: str) -> None:
    env = ddpkit.init_distributed("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    _one_rank_late(env, report, frozen, freeze=True)
    ddpkit.destroy()


def _run_frozen(frozen: int, report) -> None:
    """Three ranks, one of which SIGSTOPs itself; the first to exit must be a hang reporter.

    A stopped process does not act on SIGTERM until it is continued, so the launcher must escalate
    to SIGKILL; torch's join does so after ``grace_period`` (30 s by default, 1 s here).
    """
    context = mp.start_processes(
        _frozen_rank, args=(free_port(), frozen, str(report)), nprocs=3, join=False, start_method="spawn"
    )
    with pytest.raises(mp.ProcessExitedException) as failed:
        while not context.join(grace_period=1.0):
            pass
    assert not any(p.is_alive() for p in context.processes)
    assert failed.value.exit_code == HANG_EXIT_CODE


@pytest.mark.slow
def test_frozen_rank_is_reported_as_not_answering(tmp_path):
    report = tmp_path / "hang.txt"
    _run_frozen(2, report)
    text = report.read_text()
    assert "rank 2 has not reached it" in text and "rank 2 last issued #1, 1 behind" in text
    assert "rank 2: issued #1, step 2, phase 'gradient all_reduce'" in text
    assert "no answer: stopped (SIGSTOP), dead, or holding the GIL" in text
    assert "stack of rank 0" in text and "stack of rank 1" in text and "stack of rank 2" not in text


@pytest.mark.slow
def test_frozen_store_host_still_gets_a_report(tmp_path):
    """Under tcp:// (and ddpkit.launch) rank 0 hosts the store: freezing it freezes the store too."""
    report = tmp_path / "hang.txt"
    _run_frozen(0, report)
    text = report.read_text()
    assert "the rendezvous store did not answer" in text and "this rank's view only" in text
    assert "issued #2 (gloo:all_reduce), step 2, phase 'gradient all_reduce'" in text
    assert "stack of rank 0" not in text and "in all_reduce" in text


def _quick_steps(env: DistEnv) -> tuple[float, bool]:
    total = torch.zeros(1)
    with HangWatchdog(env, TIMEOUT_S, poll_s=POLL_S) as watchdog:
        for step in range(1, 11):
            watchdog.phase(step, "gradient all_reduce")
            value = torch.full((1,), float(env.rank + step))
            dist.all_reduce(value)
            total += value
    leftover = any(t.name == "ddpkit-hang-watchdog" for t in threading.enumerate())
    return total.item(), leftover


@pytest.mark.slow
def test_no_false_alarm_and_stop_leaves_no_thread():
    results = run_ranks(_quick_steps, 3)
    # sum over steps 1..10 of (0 + 1 + 2 + 3 * step) = 30 + 3 * 55
    assert results == [(195.0, False)] * 3
