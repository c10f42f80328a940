"""What a worker writes for its launcher, and the one place the hang system reads torch's
private state.

Its collective count: with ``DDPKIT_PROGRESS_S`` set, a daemon thread writes the default process
group's sequence number to ``RUN_DIR/progress-RANK`` when it changes (one read of a counter and at
most one small write per period); the launcher reads it into a ``RankState`` (``workers.py``).

Its stacks: ``faulthandler`` writes every thread's Python stack to ``RUN_DIR/stacks-RANK.txt``
when the launcher sends ``STACK_SIGNAL`` (the hang report, ``workers.dump_stacks``), and
to ``RUN_DIR/exit-RANK.txt`` when the agent stops the worker with SIGTERM (where the others were
when a rank failed, ``failures.write_exit_stacks``). Its handler runs in C, so it answers while
the main thread waits inside a collective.

torch's private state, read here alone, as no public API gives it (checked on torch 2.13): a
group's collective count (``_get_sequence_number_for_group``), its timeout (its backend's
``options._timeout``), the default group's store (``_get_default_store``), and the flight recorder
(``_dump_fr_trace``: which collective a rank waits in). A read that fails costs the detail it
gives, never the run.

Standard library only at the top: ``launch/workerboot/sitecustomize.py`` loads this file by its
path in every worker, before the script, and importing the ddpkit package would import torch.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import IO

THREAD_FUNCTION = "_watch_progress"  # workers.py leaves this thread out of a rank's stacks
# The launcher's request for a worker's stacks, a real-time signal: no script or library uses one
# for itself (macOS has none: SIGUSR2 there). Both sides read it here, so no variable carries it.
STACK_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


def default_group():
    """The default process group, or None (not created yet, torch half-imported, being destroyed)."""
    c10d = getattr(sys.modules.get("torch.distributed"), "distributed_c10d", None)
    try:
        return c10d.group.WORLD if c10d is not None else None
    except Exception:
        return None


def sequence_number(group) -> int:
    """The group's collective count; -1 without a group."""
    try:
        return group._get_sequence_number_for_group() if group is not None else -1
    except Exception:
        return -1


def group_timeout_s(group) -> float:
    """The timeout the script gave its process group (torch's default unless it chose one); 0 if unknown."""
    try:
        return group._get_backend(group._device_types[0]).options._timeout.total_seconds()
    except Exception:  # private API: without it the launcher falls back to torch's default
        return 0.0


def default_store():
    """The default group's store (the process group must exist)."""
    return sys.modules["torch.distributed"].distributed_c10d._get_default_store()


def flight_entries(group_name: str) -> list[dict]:
    """The flight recorder's entries of group ``group_name``'s collectives, oldest first.

    The recorder keeps the last collectives of every group (on by default for gloo and NCCL in
    torch 2.13; TORCH_FR_BUFFER_SIZE sets how many, 2000 by default). A dump takes about 0.2 ms
    with a few entries and some 50 ms with 2000, so it is taken when a rank has been idle a while
    or a hang is being reported, never per step. Point-to-point entries are left out: a send and
    its recv share a sequence number under different names. Returns [] when the recorder is off
    or unavailable.

    Args:
        group_name: the process group's ``group_name`` ("0" for the default group).
    """
    import logging  # here, not at the top: a worker's boot loads this file before its script
    import pickle

    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        entries = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False))
    except Exception as exc:  # a missing or changed recorder only costs the op name
        logging.getLogger(__name__).debug("flight recorder unavailable: %s", exc)
        return []
    ours = [
        entry
        for entry in entries.get("entries", [])
        if entry.get("process_group", ("",))[0] == group_name and not entry.get("is_p2p", False)
    ]
    return sorted(ours, key=lambda entry: entry.get("record_id", 0))  # a wrapped ring, in order


def _watch_progress(path: str, period_s: float, stop: threading.Event) -> None:
    """Write ``PID SEQ WALL LEFT WORLD TIMEOUT`` whenever the sequence number changes, in one
    fixed-size record.

    ``LEFT`` is 1 once the group is gone after it existed (``destroy_process_group``); ``SEQ``
    then keeps its last value. ``TIMEOUT`` is the group's own timeout, in seconds. ``os.pwrite``
    on a raw descriptor takes no Python lock, so a fork in the main thread (a DataLoader starting
    workers) never copies a lock this thread holds.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    world, last, record, timeout = os.environ.get("WORLD_SIZE", "0"), None, -1, 0.0
    while True:
        group = default_group()
        seq = sequence_number(group)
        if seq >= 0 and record < 0:
            timeout = group_timeout_s(group)
        record = seq if seq >= 0 else record
        now = (record, record >= 0 and seq < 0)  # (the last count seen, whether the group is gone)
        # Hold no reference to the group while sleeping: one kept after destroy_process_group()
        # lives until interpreter shutdown, where its gloo threads abort the process (SIGABRT,
        # "terminate called without an active exception") after a run that ended well.
        group = None
        if now != last:
            last = now
            line = f"{os.getpid()} {record} {time.time():.3f} {int(now[1])} {world} {timeout:.0f}"
            os.pwrite(fd, line.ljust(63).encode() + b"\n", 0)
        if stop.wait(period_s):
            break
    os.close(fd)


class ProgressWriter:
    """The thread that writes ``progress-RANK``; paused and resumed to measure what it costs.

    Args:
        run_dir: the launcher's run directory.
        rank: this worker's global rank.
        period_s: how often to read the count.
    """

    def __init__(self, run_dir: str, rank: str, period_s: float) -> None:
        self.path, self.period_s = os.path.join(run_dir, f"progress-{rank}"), period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def resume(self) -> None:
        """Start the thread (again, after ``pause``)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        args = (self.path, self.period_s, self._stop)
        self._thread = threading.Thread(
            target=_watch_progress, args=args, name="ddpkit-progress", daemon=True
        )
        self._thread.start()

    def pause(self) -> None:
        """Stop the thread (at exit, before interpreter shutdown tears torch down under it)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2 * self.period_s)


def register_stacks(run_dir: str, rank: str) -> list[IO]:
    """Register the two dumps; returns the files, which the caller must keep open.

    Args:
        run_dir: the launcher's run directory.
        rank: this worker's global rank.
    """
    on_request = open(os.path.join(run_dir, f"stacks-{rank}.txt"), "w")  # noqa: SIM115
    on_exit = open(os.path.join(run_dir, f"exit-{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(STACK_SIGNAL, file=on_request, all_threads=True, chain=False)
    # chain=True: after the dump, SIGTERM does what it did before (ends the process). A script
    # that installs its own SIGTERM handler replaces this one, and keeps its behaviour.
    faulthandler.register(signal.SIGTERM, file=on_exit, all_threads=True, chain=True)
    # A forked child (a DataLoader worker) inherits the handlers and the files; its stacks are not
    # the rank's, and an unhandled real-time signal would kill it: give it the defaults back.
    os.register_at_fork(after_in_child=_unregister)
    return [on_request, on_exit]


def _unregister() -> None:
    faulthandler.unregister(STACK_SIGNAL)
    faulthandler.unregister(signal.SIGTERM)
