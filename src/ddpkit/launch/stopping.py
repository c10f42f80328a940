"""A launcher stopped by a signal: forward it, give the workers a grace period, then end them.

torch's elastic agent turns SIGTERM or SIGINT into a ``SignalException``, closes the workers with
the same signal and a timeout, and re-raises: torchrun prints a traceback and exits with 1, and
a second signal during the wait starts another wait instead of ending it. ``StopOnSignal`` takes
SIGTERM, SIGINT and any early-warning signal (SLURM's ``--signal=USR1@120``) from the agent and,
in the launcher's main thread:

    running --(first signal)--> grace: the signal goes to every worker's process group (SIGTERM
        for an early-warning signal, the one a preemption-aware script handles); wait until all
        have exited or ``grace_s`` passed, then SIGKILL what is left
    grace --(second signal)--> the workers are SIGKILLed and the launcher exits at once with
        128 + the signal; a checkpoint being written is abandoned (written to a temporary name),
        so the previous good one stays
    grace --(all exited, or killed)--> the agent's own shutdown finds nothing left to stop, and
        ``run_elastic`` prints one line (``outcome``) and raises ``Stopped`` (exit 128 + signal)

The workers' exit statuses are read with ``waitid(WNOWAIT)``, which leaves them for the agent to
reap, so the agent sees every exit as it would have.

When a worker fails, the agent stops the others itself, with SIGTERM and a fixed 30 s before
SIGKILL (whatever ``--shutdown-timeout`` says); ``failure_grace`` makes that wait the grace period
too, so a rank frozen in a hang does not hold the job's end for 30 s when a shorter one was asked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import PContext, SignalException

from ddpkit.diagnostics.exit_codes import exit_code_for_signal
from ddpkit.errors import ConfigError

GRACE_S = 30.0  # torch's own shutdown timeout, and long enough for a checkpoint of a large model
ALWAYS = ("SIGTERM", "SIGINT")
TORCH_KEEPS = ("SIGHUP", "SIGQUIT")  # left to torch's agent: a closed terminal, a core dump request
GRACE_HELP = (
    "seconds the workers get after SIGTERM, SIGINT or --preempt-signal to finish their step, "
    "checkpoint and exit, before they are killed (a second signal kills them at once)"
)
PREEMPT_HELP = (
    "another signal that stops the run as SIGTERM does, e.g. SIGUSR1 for SLURM's --signal=USR1@120 "
    "early warning; the workers get SIGTERM"
)
KILL_WAIT_S = 5.0  # a SIGKILLed process in the kernel (D state) may take a moment to end
AGENT_LOG = logging.getLogger("torch.distributed.elastic.agent.server.api")


@contextlib.contextmanager
def failure_grace(grace_s: float) -> Iterator[None]:
    """While the agent runs: the workers left after a failure get ``grace_s`` to exit, not 30 s.

    torch's ``PContext.close(death_sig=None, timeout=30)`` is called without a timeout on that
    path; its default is set here, and put back after. A torch whose ``close`` has other
    arguments is left alone.
    """
    defaults = PContext.close.__defaults__
    if defaults is None or len(defaults) != 2 or not isinstance(defaults[1], int):
        yield
        return
    PContext.close.__defaults__ = (defaults[0], max(0, math.ceil(grace_s)))
    try:
        yield
    finally:
        PContext.close.__defaults__ = defaults


class Stopped(SystemExit):
    """The launcher was stopped by a signal; the process exits with ``128 + signum``, as a shell
    reports a process a signal ended (130 for Ctrl-C, 143 for SIGTERM).

    Args:
        signum: the signal the launcher received.
        line: what happened, in one line (already printed).
    """

    def __init__(self, signum: int, line: str) -> None:
        super().__init__(exit_code_for_signal(signum))
        self.signum, self.line = signum, line


def parse_signal(name: str, flag: str = "--preempt-signal") -> signal.Signals:
    """``USR1``, ``SIGUSR1`` or ``10`` as a signal the launcher may catch."""
    text = name.strip().upper()
    try:
        full = text if text.startswith("SIG") else f"SIG{text}"
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[full]
    except (KeyError, ValueError):
        sig = None
    if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
        raise ConfigError(
            f"{flag} {name!r} is not a signal a launcher can catch; use a name such as SIGUSR1 or SIGTERM"
        )
    return sig


def split_signals(torch_list: str, preempt: str | None) -> tuple[list[signal.Signals], str]:
    """(the signals ddpkit handles, the ``signals_to_handle`` string left to torch's agent).

    Args:
        torch_list: torchrun's ``--signals-to-handle`` (its default: SIGTERM,SIGINT,SIGHUP,SIGQUIT).
        preempt: ``--preempt-signal``, or None.
    """
    names = [n.strip() for n in torch_list.split(",") if n.strip()]
    ours = {parse_signal(n, "--signals-to-handle") for n in names if n.strip().upper() not in TORCH_KEEPS}
    ours |= {signal.Signals[n] for n in ALWAYS}
    if preempt:
        ours.add(parse_signal(preempt))
    # torch registers a handler for each name it is given, and warns with a traceback for an empty
    # one; SIGQUIT is what it handles anyway.
    return sorted(ours), ",".join(n for n in names if n.upper() in TORCH_KEEPS) or "SIGQUIT"


class StopOnSignal:
    """The launcher's handlers for the stop signals, while its agent runs (see the module docstring).

    Args:
        signals: the signals that stop the job.
        grace_s: how long the workers may take to exit after the signal before they are SIGKILLed.
    """

    def __init__(self, signals: list[signal.Signals], grace_s: float) -> None:
        self.signals, self.grace_s = signals, grace_s
        self.received: signal.Signals | None = None
        self.outcome = ""
        self._previous: dict[int, object] = {}
        self._workers: dict[int, str] = {}  # pid -> how it ended

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        AGENT_LOG.addFilter(self._quiet)
        return self

    def __exit__(self, *exc: object) -> None:
        AGENT_LOG.removeFilter(self._quiet)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def report(self, sig: signal.Signals) -> Stopped:
        """Say once what the stop did, without torch's traceback; raise the result to exit."""
        # SIGHUP and SIGQUIT stay with torch's agent, which forwards them itself.
        code = exit_code_for_signal(sig)
        line = self.outcome or f"stopped by {sig.name}: the agent sent it to the workers (exit code {code})"
        print(f"ddpkit: {line}", file=sys.stderr, flush=True)
        return Stopped(sig, line)

    def _quiet(self, record: logging.LogRecord) -> bool:
        # The agent's "Received 15 death signal, shutting down workers": the line run_elastic
        # prints says it, with what became of the workers.
        return self.received is None or "death signal" not in record.getMessage()

    def _handle(self, signum: int, frame: object) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            self._second(sig)
        self.received = sig
        self.outcome = self._stop_workers(sig)
        # The agent stops its loop, finds every worker gone, and re-raises this for run_elastic.
        raise SignalException(f"ddpkit launcher got {sig.name}", sigval=sig)

    def _second(self, sig: signal.Signals) -> None:
        for pid in child_pids():
            _kill_group(pid, signal.SIGKILL)
        first = self.received.name if self.received else sig.name
        print(
            f"ddpkit: stopped by a second signal ({sig.name} after {first}): workers killed at once; a "
            "checkpoint ddpkit was writing is abandoned, the previous good one stays "
            f"(exit code {exit_code_for_signal(sig)})",
            file=sys.stderr,
            flush=True,
        )
        os._exit(exit_code_for_signal(sig))  # at once: no cleanup that could wait on anything

    def _stop_workers(self, sig: signal.Signals) -> str:
        """Forward ``sig``, wait up to the grace period, kill what is left; what happened, as text."""
        forward = sig if sig in (signal.SIGTERM, signal.SIGINT) else signal.SIGTERM
        started = time.monotonic()
        pids = child_pids()
        for pid in pids:
            _kill_group(pid, forward)
        ended: dict[int, str] = {}
        while len(ended) < len(pids) and time.monotonic() - started < self.grace_s:
            ended.update({pid: how for pid in pids if pid not in ended and (how := exit_status(pid))})
            time.sleep(0.05)
        took = time.monotonic() - started
        late = [pid for pid in pids if pid not in ended]
        for pid in late:
            _kill_group(pid, signal.SIGKILL)
        # Dead before the agent looks: it would send its own signal to a process still dying.
        deadline = time.monotonic() + KILL_WAIT_S
        while any(not exit_status(pid) for pid in late) and time.monotonic() < deadline:
            time.sleep(0.01)
        return describe(sig, forward, list(ended.values()), len(late), took, self.grace_s)


def describe(
    sig: signal.Signals,
    forward: signal.Signals,
    ends: list[str],
    late: int,
    took: float,
    grace_s: float,
    *,
    grace_flag: str = "--grace-period",
    resume: str = "",
) -> str:
    """One line: what the signal did to the workers, and how to resume (by default: the same
    command, and the launcher's exit code); ``grace_flag`` names what sets the grace period, if anything."""
    by_itself = [e for e in ends if not e.startswith("SIG")]
    by_signal = [e for e in ends if e.startswith("SIG")]
    sent = "" if forward == sig else f" (sent {forward.name})"
    parts = [] if ends or late else ["no worker was running"]
    if by_itself:
        codes = ", ".join(sorted(set(by_itself)))
        parts.append(
            f"{_workers(by_itself)}{sent} exited {took:.1f} s after it with exit code {codes} "
            "(a ddpkit.Run script checkpoints its step first)"
        )
    if by_signal:
        parts.append(
            f"{_workers(by_signal)}{sent} ended by {', '.join(sorted(set(by_signal)))}, which the script "
            "does not handle (nothing saved at the signal)"
        )
    if late:
        parts.append(
            f"{_workers(range(late))}{sent} still running after the {grace_s:g} s grace period, killed"
            + (f" ({grace_flag} sets it)" if grace_flag else "")
        )
    code = exit_code_for_signal(sig)
    resume = resume or (
        f"the same command resumes from the newest checkpoint the script wrote (exit code {code})"
    )
    return f"stopped by {sig.name}: " + "; ".join([*parts, resume])


def _workers(items) -> str:
    return "1 worker" if len(items) == 1 else f"{len(items)} workers"


def child_pids() -> list[int]:
    """This process's children: the agent's workers (the launcher starts no other process)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(stat[1]) == me and stat[0] not in ("Z", "X"):
                found.append(int(entry))
    return found


def exit_status(pid: int) -> str:
    """How a child ended (``"143"``, ``"SIGTERM"``), without reaping it; ``""`` while it runs."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "?"  # reaped already by someone else: it ended, how is not known here
    if info is None:
        return ""
    if info.si_code == os.CLD_EXITED:
        return str(info.si_status)
    return signal.Signals(info.si_status).name


def _kill_group(pid: int, sig: signal.Signals) -> None:
    # The agent starts each worker in a session of its own: its group holds its DataLoader workers.
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # not a group leader after all: signal the process alone
        os.kill(pid, sig)
