"""Hang attribution: when a collective does not complete in time, say who is behind and where.

Every rank runs a ``HangWatchdog``: a daemon thread that watches the rank's own progress (the
default group's collective sequence number, which gloo and NCCL advance when a collective is
issued, and the phase the training loop last announced with ``phase()``) and publishes it in the
rendezvous store whenever it changes (the keys: ``exchange.py``). Each watchdog thread goes
through these states:

    watching --(own idle >= timeout_s; store.add(REPORTER) == 1)--> reporting
        reporting: set REQUEST, collect answers for answer_s, print and write the report,
                   os._exit(HANG_EXIT_CODE); the launcher then stops the other ranks.
    watching --(store.add(REPORTER) > 1, or REQUEST appears)--> following
        following: answer REQUEST once with a fresh state and the main thread's stack; exit
                   follow_s later, in case the launcher does not stop this rank.
    watching --(store unreachable at the timeout)--> report this rank's view alone and exit.
    watching --(every rank blocked desync_s in different collectives, desync.py)--> as at
               the timeout, with the desync as the report's first line.

A rank frozen by SIGSTOP (its watchdog thread is frozen too), dead, or holding the GIL cannot
answer: the report shows its last published state and says it did not answer.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from ddpkit.diagnostics.exit_codes import HANG_EXIT_CODE
from ddpkit.diagnostics.hang.boot_progress import default_store, sequence_number
from ddpkit.diagnostics.hang.desync import Blocked, DesyncProbe, desync_headline, desync_line
from ddpkit.diagnostics.hang.exchange import BoundedStore, Exchange, own_client
from ddpkit.diagnostics.hang.record import Progress, RankState
from ddpkit.diagnostics.hang.report import format_report, summary_line, write_report
from ddpkit.diagnostics.hang.stacks import inflight_op, thread_stack
from ddpkit.diagnostics.hang.timings import TIMINGS
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)

ALONE = (
    "the rendezvous store did not answer (its host may be stopped or dead: rank 0 under "
    "ddpkit.launch, the agent under ddpkit run/torchrun), so this is this rank's view only"
)


class HangWatchdog:
    """Reports which ranks have not reached which collective when one does not complete in time.

    Start it once the process group exists, from the training thread (the one whose stack the
    report shows); call ``phase()`` before each collective-bearing phase::

        with HangWatchdog(env, timeout_s=1800, report_path=out / "hang-report.txt") as watchdog:
            for step in range(1, steps + 1):
                watchdog.phase(step, "forward/backward: gradient all-reduce")
                ...

    Args:
        env: this process's distributed environment.
        timeout_s: seconds without progress of this rank before the job is declared hung.
        poll_s: how often the watchdog thread checks progress and the store (about 2 store calls).
        report_path: a file the reporting rank also writes the report to; stderr always gets it.
        store: where ranks meet; a clone of the default group's store when None.
        desync_s: seconds every rank may wait in its collective, the ranks' collectives
            differing, before the job is reported as a desync (a collective only some ranks
            called); 0 disables. A slow rank never counts (see ``desync.py``).
        startup_s: seconds without progress allowed until ``steady()`` is called (the loop's
            first step has ended): DDP's constructor, a checkpoint load and the data workers'
            start take as long as the machine's load makes them, whatever ``timeout_s`` says;
            the larger of the two applies (torchtitan's init and train timeouts).
    """

    follow_s = TIMINGS.follow_s  # a subclass may shorten it

    def __init__(
        self,
        env: DistEnv,
        timeout_s: float,
        *,
        poll_s: float = TIMINGS.poll_s,
        report_path: Path | str | None = None,
        store: dist.Store | None = None,
        desync_s: float = TIMINGS.desync_s,
        startup_s: float = 0.0,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"--collective-timeout must be a positive number of seconds, got {timeout_s!r}")
        if not 0 < poll_s < timeout_s:
            raise ConfigError(f"poll_s must be between 0 and the timeout ({timeout_s:g} s), got {poll_s!r}")
        if not desync_s >= 0:
            raise ConfigError(f"desync_timeout must be 0 (off) or a number of seconds, got {desync_s!r}")
        self.env, self.timeout_s, self.poll_s = env, float(timeout_s), float(poll_s)
        self.desync_s, self._probe = float(desync_s), None
        self.startup_s, self._steady = float(startup_s), False
        self.report_path = Path(report_path) if report_path is not None else None
        self.answer_s = 2 * self.poll_s + TIMINGS.answer_margin_s
        self._given_store = store
        self._store: BoundedStore | None = None
        self._exchange: Exchange | None = None
        self._mark: tuple[int, str] = (0, "started")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main_ident = threading.get_ident()
        self._group: dist.ProcessGroup | None = None
        self._progress = Progress(time.monotonic())
        self._following_since: float | None = None

    def phase(self, step: int, name: str) -> None:
        """Announce the phase the training loop enters, e.g. ``phase(12, "log: loss all_reduce")``.

        Cheap enough for every step: one attribute store, no I/O. The watchdog thread reads the
        tuple whole (one assignment is atomic under the GIL) at its next poll.

        Args:
            step: the training step.
            name: the phase and the collective it runs, shown in the report.
        """
        self._mark = (step, name)

    def steady(self) -> None:
        """Start-up is over (the first step ended): from now on ``timeout_s`` alone applies."""
        self._steady = True

    @property
    def limit_s(self) -> float:
        """The timeout in force: ``timeout_s``, or during start-up the larger of it and ``startup_s``."""
        return self.timeout_s if self._steady else max(self.timeout_s, self.startup_s)

    def _source(self) -> str:
        starting = not self._steady and self.startup_s > self.timeout_s
        return "startup_timeout: the first step had not ended" if starting else "--collective-timeout"

    def start(self) -> HangWatchdog:
        """Start watching; the calling thread is the one whose stack the report shows."""
        if self._thread is not None:
            raise RuntimeError("HangWatchdog.start() called twice; call stop() first")
        self._main_ident = threading.get_ident()
        initialized = dist.is_available() and dist.is_initialized()
        self._group = dist.group.WORLD if initialized else None
        if self._given_store is None and self._group is None:
            raise ConfigError("HangWatchdog needs a process group: call ddpkit.init_distributed() first")
        given = self._given_store
        self._store = BoundedStore(given if given is not None else own_client(default_store()))
        self._exchange = Exchange(self._store, self.env.rank)
        self._probe = None
        if self.desync_s and self._group is not None:
            # A blocked rank compares every desync_s / 10, at least a poll apart: the report comes
            # seconds after desync_s, and each check is two or three store calls per blocked rank.
            check_s = max(self.poll_s, self.desync_s * TIMINGS.desync_check_share)
            args = (self._group.group_name, self.desync_s, check_s, self._store, self._main_ident)
            self._probe = DesyncProbe(self.env.rank, self.env.world_size, *args)
        self._progress = Progress(time.monotonic())
        self._following_since = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ddpkit-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and join the thread; safe to call twice or before ``start()``."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=self.poll_s + 2 * TIMINGS.store_timeout_s)
        self._store.close()

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._tick(time.monotonic())
                self._stop.wait(self.poll_s)
            if self._probe is not None:
                self._probe.clear()  # a record left behind would count as blocked for ever
            # Tells a later report that this rank left the watched loop rather than froze.
            self._exchange.publish(self._progress.state(self.env.rank, time.monotonic(), left=True))
        except Exception:
            # The watchdog must never take training down by itself.
            log.exception("hang watchdog failed; training continues unwatched")

    def _tick(self, now: float) -> None:
        if self._group is not None and not dist.is_initialized():
            # destroy() without stop(): no collective can hang any more, and idling on would
            # end in a false report.
            self._stop.set()
            return
        progressed = self._progress.observe(self._sequence_number(), self._mark, now)
        if progressed:
            self._exchange.publish(self._progress.state(self.env.rank, now))
        if self._exchange.asked():
            self._answer(now)
        if self._following_since is not None:
            self._follow(now)
        elif self._progress.idle(now) >= self.limit_s:
            self._on_timeout(now)
        elif self._probe is not None:
            if desync := self._probe.tick(now, self._progress.idle(now), progressed):
                self._on_timeout(now, desync)

    def _sequence_number(self) -> int:
        if self._group is None:
            return 0
        seq = sequence_number(self._group)  # -1: the group was destroyed under a running watchdog
        return seq if seq >= 0 else max(self._progress.seq, 0)

    def _fresh_state(self, now: float) -> RankState:
        state = self._progress.state(self.env.rank, now)
        name = self._group.group_name if self._group is not None else ""
        return replace(state, op=inflight_op(name, state.seq)) if name else state

    def _answer(self, now: float) -> None:
        self._exchange.answer(self._fresh_state(now), thread_stack(self._main_ident))
        self._following_since = self._following_since or now

    def _follow(self, now: float) -> None:
        """Another rank is reporting; exit a while after it, should the launcher not stop this rank."""
        if now - self._following_since < self.answer_s + self.follow_s:
            return
        reporter = self._exchange.reporter() if self._exchange.answered else None
        who = f"rank {reporter}" if reporter is not None else "another rank"
        log.error("%s reported a hang (see its report); exiting with code %d", who, HANG_EXIT_CODE)
        self._exit(HANG_EXIT_CODE)

    def _on_timeout(self, now: float, desync: list[Blocked] | None = None) -> None:
        claim = self._exchange.claim()
        if claim is None:
            self._report(now, alone=ALONE)
        elif claim == 1:
            self._report(now, desync)
        else:
            self._following_since = now  # a peer claimed the report; it will ask for our stack

    def _report(self, now: float, desync: list[Blocked] | None = None, alone: str = "") -> None:
        """Gather every rank's state and stack (``alone``: this rank's only), then print and write
        the report and exit."""
        rank, size = self.env.rank, self.env.world_size
        states, stacks = {rank: self._fresh_state(now)}, {rank: thread_stack(self._main_ident)}
        if not alone:
            self._exchange.request()
            peers = set(range(size)) - {rank}
            for peer, (state, stack) in self._exchange.answers(peers, self.answer_s).items():
                states[peer], stacks[peer] = state, stack
            states = {**self._exchange.states(set(range(size)) - set(states)), **states}
            path = str(self.report_path) if self.report_path is not None else ""
            line = desync_line(desync) if desync else summary_line(states, size, set(stacks))
            self._exchange.summarize(line, path)
        headline = desync_headline(desync, self.desync_s) if desync else ()
        when, source = time.time(), self._source()
        self._emit(format_report(rank, self.limit_s, size, states, stacks, when, alone, headline, source))

    def _emit(self, text: str) -> None:
        # Straight to stderr, not through logging: os._exit follows, which flushes no handler,
        # and the report must reach the launcher's console whatever logging was configured.
        prefix = f"[rank {self.env.rank}] "
        sys.stderr.write("".join(prefix + line + "\n" for line in text.splitlines()))
        if self.report_path is not None:
            write_report(self.report_path, text)
        self._exit(HANG_EXIT_CODE)

    def _exit(self, code: int) -> None:
        """End the process: its main thread is stuck in a collective and cannot be interrupted."""
        # ddpkit's logger does not propagate to the root (ddpkit.logs.setup_logging): flush both.
        for name in ("", "ddpkit"):
            for handler in logging.getLogger(name).handlers:
                handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
