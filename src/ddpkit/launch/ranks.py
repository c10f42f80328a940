"""The processes of one ``ddpkit.launch``: started from a thread of their own, each in a session
of its own, and stopped on SIGINT or SIGTERM as ``ddpkit run`` stops its workers.

A thread of their own: a process forked from a thread that ran an OpenMP region with several
threads (any torch op on a multi-core CPU, in a notebook cell before the launch) hangs in its
own first such region, because libgomp keeps its thread pool per thread and the fork's copy waits
for pool threads that exist only in the parent. A thread that never ran one has no pool, so its
forks make their own. The thread lives until the processes are gone: Linux sends a child its
parent-death signal when the thread that forked it ends (torch asks for SIGINT, ddpkit SIGKILL).

A session of its own (``enter_rank``): Jupyter interrupts a kernel by signalling its whole process
group, so ranks in that group would get the signal twice, once from Jupyter and once forwarded,
and a ``ddpkit.Run`` takes a second signal as "exit at once", without its checkpoint.

Stopping, in the main thread (the only one Python lets handle signals):

    running --(SIGINT or SIGTERM)--> grace: the same signal to every rank's process group; wait
        until all have exited or ``grace_s`` passed (a Run finishes its step and checkpoints it),
        then SIGKILL what is left; raise KeyboardInterrupt (SIGINT) or ``Stopped`` (SIGTERM, exit
        code 143) with one line saying what became of the ranks
    grace --(second signal)--> every rank SIGKILLed at once; KeyboardInterrupt or ``Stopped``
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from ddpkit.dist.threads import share_cores
from ddpkit.launch.orphans import die_with_parent
from ddpkit.launch.stopping import GRACE_S, KILL_WAIT_S, Stopped, describe

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESUME = "launching the same function again resumes from the newest checkpoint a ddpkit.Run wrote"


def enter_rank(launcher_pid: int | None, nproc: int) -> None:
    """What a launched process does first: its own session, death with its launcher (None: with
    its parent, a forkserver that ends with the launcher), the default handlers for the stop
    signals (a forked one inherits the launcher's), its share of the cores."""
    os.setsid()
    die_with_parent(launcher_pid)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    share_cores(nproc)  # a forked process would keep the parent's thread count (every core)


class Signalled(Exception):
    """A stop signal reached the launcher; raised by its handler to leave torch's join at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class LocalRanks:
    """Start ``nproc`` processes running ``child(local_rank, *args)``, wait, stop them on a signal.

    Args:
        child: the function each process runs (``torch.multiprocessing`` passes the local rank).
        args: its other arguments.
        nproc: how many processes.
        method: ``"spawn"``, ``"fork"`` or ``"forkserver"`` (see ``ddpkit.launch.start_method``).
        grace_s: how long the ranks get after a stop signal before they are killed.
    """

    def __init__(
        self, child: Callable[..., Any], args: tuple, nproc: int, method: str, grace_s: float = GRACE_S
    ) -> None:
        self.child, self.args, self.nproc, self.method, self.grace_s = child, args, nproc, method, grace_s
        self.context: mp.ProcessContext | None = None
        self.start_error: BaseException | None = None
        self.started, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._start_and_stay, name="ddpkit-launch", daemon=True)
        self.stopping = False

    def run(self) -> None:
        """Start the processes and wait for all; raise what torch's join raises when one fails."""
        previous = self._handle_signals()
        try:
            try:
                self._wait()
            except Signalled as stop:
                self._stop(signal.Signals(stop.signum))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._release()

    def _wait(self) -> None:
        # A forked child shares this process's objects, garbage from an earlier cell included (an
        # exception's traceback holding a TCPStore): a collection there runs their destructors, and
        # a TCPStore's joins a server thread the child does not have (a hang) and closes descriptors
        # it shares with this process. Frozen objects are never collected, in the children either.
        if self.method == "fork":
            gc.freeze()
        try:
            self.thread.start()
            self.started.wait()
        finally:
            if self.method == "fork":
                gc.unfreeze()  # only the children's copies stay frozen
        if self.start_error is not None:
            raise self.start_error
        while not self.context.join():
            pass

    def _start_and_stay(self) -> None:
        try:
            self.context = mp.start_processes(
                self.child, args=self.args, nprocs=self.nproc, join=False, start_method=self.method
            )
        except BaseException as exc:  # noqa: BLE001 (handed to the main thread, which raises it)
            self.start_error = exc
        finally:
            self.started.set()
        self.done.wait()  # the ranks' parent-death signal fires when this thread ends

    def _handle_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # Python's rule: only the main thread handles signals
        return {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        if self.stopping:
            self._kill_all()
            raise self._ended(
                signal.Signals(signum),
                "stopped by a second signal: the processes were killed at once; a checkpoint being "
                "written is abandoned, the previous good one stays",
            ) from None
        raise Signalled(signum)

    def _stop(self, sig: signal.Signals) -> None:
        """Forward ``sig``, wait up to the grace period, kill what is left; raise with one line."""
        self.stopping = True
        if self.thread.ident is not None:  # started: wait for every process to be there
            self.started.wait()
        processes = self.context.processes if self.context is not None else []
        started = time.monotonic()
        for process in processes:
            signal_rank(process.pid, sig)
        while any(p.is_alive() for p in processes) and time.monotonic() - started < self.grace_s:
            time.sleep(0.05)
        took = time.monotonic() - started
        late = [p for p in processes if p.is_alive()]
        self._kill_all()
        ends = [how_it_ended(p.exitcode) for p in processes if p not in late]
        line = describe(sig, sig, ends, len(late), took, self.grace_s, grace_flag="", resume=RESUME)
        raise self._ended(sig, line) from None  # the one line; not the Signalled it handles

    @staticmethod
    def _ended(sig: signal.Signals, line: str) -> BaseException:
        if sig == signal.SIGINT:
            return KeyboardInterrupt(line)
        print(f"ddpkit: {line}", file=sys.stderr, flush=True)  # SystemExit prints nothing itself
        return Stopped(sig, line)

    def _kill_all(self) -> None:
        if self.context is None:
            return
        for process in self.context.processes:
            if process.is_alive():
                signal_rank(process.pid, signal.SIGKILL)
        for process in self.context.processes:
            process.join(KILL_WAIT_S)

    def _release(self) -> None:
        """Nothing outlives the launch: what still runs (an error in the launcher) is killed, then
        the starting thread may end."""
        if self.thread.ident is None:
            return
        self.started.wait()
        self._kill_all()
        self.done.set()
        self.thread.join()


def signal_rank(pid: int, sig: signal.Signals) -> None:
    """``sig`` to a rank's process group (its DataLoader workers too), or to the rank alone while it
    has not made its session yet."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def how_it_ended(exitcode: int | None) -> str:
    """``"130"`` for an exit code, ``"SIGKILL"`` for a signal (``describe``'s words)."""
    if exitcode is not None and exitcode < 0:
        return signal.Signals(-exitcode).name
    return str(exitcode)
