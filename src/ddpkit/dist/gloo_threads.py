"""Gloo's worker threads and the GIL: let them go idle before a fork or a process group's end.

A gloo worker thread (torch names it ``pt_gloo_runloop``) that has just finished a collective
drops the tensors the collective held. Where a tensor also has a Python object, that drop takes
the GIL; the thread has no Python thread state, so pybind11 first creates one (under CPython's
interpreter lock, HEAD_LOCK, without the GIL) and deletes it after. Two hangs follow from that
moment, both seen in this project's CI and reproduced by looping a test (what the first looks
like from outside is in docs/troubleshooting.md, under Hangs):

- ``os.fork()`` (a DataLoader starting its worker processes at an epoch's start) while the thread
  holds HEAD_LOCK: CPython up to 3.11 re-takes that lock in the child before resetting it
  (gh-112275, fixed in 3.12), so the DataLoader worker never runs a line, the rank waits for its
  batch for ever, and its peers wait in the next collective.
- the group's last reference dropped by code that holds the GIL (torch's DDP ``Reducer`` freed by
  the garbage collector): ``~ProcessGroupGloo`` joins its worker threads while the thread that
  waits for the GIL to drop a tensor never gets it.

``settle`` releases the GIL until every gloo worker thread of the process has stayed asleep, not
scheduled once, through a short window in which the GIL was free. A thread that wanted the GIL
would have taken it in that window, so what is left sleeps in gloo's own queue. It runs before
every ``os.fork()`` of a process that imported ddpkit (registered here, at import, with
``os.register_at_fork``: a DataLoader's workers, ddpkit's or the user's own, and any other fork;
without gloo threads it returns at once), before ddpkit leaves a process group, and at exit.
"""

from __future__ import annotations

import os
import time

GLOO_THREAD = "pt_gloo_runloop"
WINDOW_S = 0.002  # the GIL is free this long; a thread waiting for it is woken when it is dropped
LIMIT_S = 2.0  # never wait longer: a thread inside a collective may sleep for its whole timeout
QUIET = ("S", "gone")  # asleep, or ended since it was listed (its group was freed meanwhile)


def gloo_worker_threads() -> list[str]:
    """The thread ids of this process's live gloo worker threads; none off Linux."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    return [task for task in tasks if _read(task, "comm").strip() == GLOO_THREAD]


def settle(limit_s: float = LIMIT_S) -> bool:
    """Wait, with the GIL released, until no gloo worker thread has a tensor drop pending.

    Returns:
        True once every gloo worker thread slept through a whole window, or when there is none;
        False after ``limit_s`` (a collective still running on a thread, or a machine too busy
        to schedule it), having waited no longer.
    """
    threads = gloo_worker_threads()
    if not threads:
        return True
    deadline = time.monotonic() + limit_s
    before = _activity(threads)
    while True:
        time.sleep(WINDOW_S)
        after = _activity(threads)
        if after == before and all(state in QUIET for state, _ in after.values()):
            return True
        if time.monotonic() > deadline:
            return False
        before = after


def _activity(threads: list[str]) -> dict[str, tuple[str, str]]:
    """Each thread's scheduler state (R, S, D...) and how many times it has been put on a CPU."""
    return {task: (_state(task), _read(task, "schedstat").rpartition(" ")[2]) for task in threads}


def _state(task: str) -> str:
    fields = _read(task, "stat").rpartition(")")[2].split()  # after "(comm)", which may hold spaces
    return fields[0] if fields else "gone"


def _read(task: str, name: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/{name}", encoding="ascii") as f:
            return f.read()
    except OSError:  # the thread ended meanwhile, or no such file on this kernel
        return ""


def _before_fork() -> None:
    settle()  # looked up at each fork, so a test can replace it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)
