"""``gloo_threads.settle`` waits until gloo's worker threads are idle, and never longer than its limit.

The hangs it prevents (a DataLoader worker forked while a gloo thread held CPython's HEAD_LOCK; a
group freed with the GIL held while a gloo thread waited for it) are races that took tens to
hundreds of runs to appear, so these tests check the mechanism instead: a thread that torch would
call a gloo worker (by its name) and that is still working keeps ``settle`` waiting, and every
fork (a DataLoader's workers) runs it first.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ddpkit.dist import gloo_threads

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")


def _as_gloo_thread(work_s: float, stop: threading.Event, worked: list[float]) -> threading.Thread:
    """A thread named as torch names gloo's workers, busy for ``work_s``, then asleep until ``stop``."""

    def body() -> None:
        ctypes.CDLL(None).prctl(15, gloo_threads.GLOO_THREAD.encode(), 0, 0, 0)  # PR_SET_NAME
        named.set()
        end = time.monotonic() + work_s
        while time.monotonic() < end:
            pass
        worked.append(time.monotonic())
        stop.wait()

    named = threading.Event()
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    named.wait()
    return thread


def test_settle_returns_once_a_working_gloo_thread_is_asleep():
    stop, worked = threading.Event(), []
    thread = _as_gloo_thread(0.3, stop, worked)
    try:
        assert len(gloo_threads.gloo_worker_threads()) >= 1
        assert gloo_threads.settle(limit_s=5) is True
        assert worked  # not before its work was done
    finally:
        stop.set()
        thread.join()


def test_settle_gives_up_at_its_limit_on_a_thread_that_never_rests():
    stop, worked = threading.Event(), []
    thread = _as_gloo_thread(1.0, stop, worked)
    try:
        started = time.monotonic()
        assert gloo_threads.settle(limit_s=0.2) is False
        assert time.monotonic() - started < 0.9 and not worked
    finally:
        stop.set()
        thread.join()


def test_every_fork_waits_for_gloo_first(monkeypatch):
    calls = []
    monkeypatch.setattr(gloo_threads, "settle", lambda: calls.append(os.getpid()))
    loader = torch.utils.data.DataLoader(torch.arange(4.0), num_workers=1, multiprocessing_context="fork")
    assert [float(x) for x in loader] == [0.0, 1.0, 2.0, 3.0]  # a user's own DataLoader, not run.loader
    assert calls == [os.getpid()]  # in the parent, before its one worker was forked


@pytest.mark.skipif(dist.is_initialized(), reason="this process already has a group")
def test_a_real_gloo_group_settles_after_a_collective():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(3))
        assert len(gloo_threads.gloo_worker_threads()) >= 1  # torch still names them so
        assert gloo_threads.settle(limit_s=5) is True
    finally:
        dist.destroy_process_group()
