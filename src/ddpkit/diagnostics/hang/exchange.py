"""What the hang collectors say to each other through a store, key by key: one conversation for
the ranks' watchdogs (a party is a rank) and for the launchers under ``ddpkit run`` (a party is a
node, speaking for its ranks).

The keys, under ``STORE_PREFIX`` for the watchdogs and ``RUN_PREFIX`` for the launchers
(the launchers read a watchdog's ``summary`` and ``request`` through ``watchdog_verdict`` below, so
this file alone knows them):

    state/RANK   each rank's progress (a ``RankState``), whenever it changes.
    reporter     a counter: the watchdog whose ``add`` makes it 1 writes the report (node 0's
                 launcher always does: it hosts the store).
    request      the reporter's party: every other party answers it once.
    answer/RANK  the answer: the rank's fresh state and the stack of its threads.
    summary      the reporter's one-line attribution (the launcher's: its whole verdict), the
                 report's path, and the reporter.
    ack/NODE     a launcher has read the summary (node 0 keeps its store up until then).

Each party calls its own client (``own_client``): a watchdog through a ``BoundedStore``, whose
calls return None rather than block, a launcher straight (under ``RUN_PREFIX``), whose failures raise.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.diagnostics.hang.record import RankState
from ddpkit.diagnostics.hang.timings import TIMINGS

log = logging.getLogger(__name__)

STORE_PREFIX = "ddpkit/hang"
RUN_PREFIX = "ddpkit/run"
REPORTER, REQUEST, SUMMARY = "reporter", "request", "summary"
STORE_METHODS = frozenset({"set", "get", "check", "add", "multi_get", "delete_key"})


def own_client(store: dist.Store, timeout_s: float = TIMINGS.store_timeout_s) -> dist.Store:
    """A client of ``store``'s server for a hang collector alone.

    The main thread may be inside a store call (new_group, a store barrier) when the collector
    needs the store, and one TCPStore client serializes its calls with a lock; ``clone()`` opens a
    second connection to the same server (c10d's "thread safe copy" of a store), whose timeout can
    then be short without touching the process group's or the agent's.

    Args:
        store: the default group's store (a watchdog), or the round's worker store (a launcher).
        timeout_s: the timeout of ``get`` and ``wait`` on the clone.
    """
    clone = store.clone()
    clone.set_timeout(timedelta(seconds=timeout_s))
    return clone


class BoundedStore:
    """Store calls that give up after ``timeout_s`` instead of blocking the caller forever.

    In torch 2.13 a TCPStore ``check`` on a store host frozen by SIGSTOP (rank 0 under
    ``ddpkit.launch``) waits for the reply forever: the store's timeout bounds ``get`` and
    ``wait``, not every call. So calls run on one daemon worker thread and the caller waits at
    most ``timeout_s``; while an earlier call is still stuck on that worker, every call fails at
    once. Failures return None. It is called as a store is (``bounded.set(key, value)``), or by
    the method's name (``bounded.call("set", key, value)``).

    Args:
        store: the store to call, prefixed with ``STORE_PREFIX``.
        timeout_s: how long one call may take.
    """

    def __init__(self, store: dist.Store, timeout_s: float = TIMINGS.store_timeout_s) -> None:
        self.store, self.timeout_s = dist.PrefixStore(STORE_PREFIX, store), timeout_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Future | None = None
        self._worker = threading.Thread(target=self._serve, name="ddpkit-hang-store", daemon=True)
        self._worker.start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            method, args, future = item
            try:
                future.set_result(getattr(self.store, method)(*args))
            except Exception as exc:
                future.set_exception(exc)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in STORE_METHODS:
            raise AttributeError(f"BoundedStore has no store method {method!r}")
        return functools.partial(self.call, method)

    def call(self, method: str, *args: Any) -> Any:
        """``store.<method>(*args)``, or None when it fails or takes longer than ``timeout_s``."""
        if self._last is not None and not self._last.done():
            return None  # the worker is still stuck in an earlier call: the store host is frozen
        self._last = future = Future()
        self._calls.put((method, args, future))
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            log.debug(
                "hang watchdog: store.%s took over %g s; the store host may be frozen", method, self.timeout_s
            )
        except RuntimeError as exc:  # DistStoreError, DistNetworkError: the host may be gone
            log.debug("hang watchdog: store.%s failed: %s", method, exc)
        return None

    def close(self) -> None:
        """Let the worker end once it is free (a worker stuck in a call stays, as a daemon)."""
        self._calls.put(None)


class Exchange:
    """One party's side of the conversation.

    Args:
        store: a watchdog's ``BoundedStore``, or a launcher's own client under ``RUN_PREFIX``.
        party: this rank (a watchdog) or this node (a launcher).
    """

    def __init__(self, store: BoundedStore | dist.Store, party: int) -> None:
        self.store, self.party = store, party
        self.answered = False  # this party answered a request, or made it

    def _get_if_set(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it is not set; never waits for it to appear."""
        return self.store.get(key) if self.store.check([key]) else None

    def publish(self, state: RankState) -> None:
        self.store.set(f"state/{state.rank}", state.to_json())

    def asked(self) -> bool:
        """True the first time this party sees a reporter's request, which it must answer."""
        if self.answered or not self.store.check([REQUEST]):
            return False
        self.answered = True
        return True

    def answer(self, state: RankState, stack: str) -> None:
        payload = {"state": asdict(state), "stack": stack}
        self.store.set(f"answer/{state.rank}", json.dumps(payload))

    def claim(self) -> int | None:
        """1 when this rank is the reporter; more when another rank is; None: no store."""
        return self.store.add(REPORTER, 1)

    def reporter(self) -> int | None:
        """The reporting party, from ``request``; None when it cannot be read."""
        raw = self.store.get(REQUEST)
        return int(raw) if raw else None

    def states(self, ranks: Iterable[int]) -> dict[int, RankState]:
        """The last published state of each of ``ranks`` that published one."""
        raws = {rank: self._get_if_set(f"state/{rank}") for rank in ranks}
        return {rank: RankState.from_json(raw) for rank, raw in raws.items() if raw is not None}

    def request(self) -> None:
        """The reporter asks every other party for its ranks' answers."""
        self.answered = True
        self.store.set(REQUEST, str(self.party))

    def answers(self, ranks: Iterable[int], wait_s: float) -> dict[int, tuple[RankState, str]]:
        """The answers of ``ranks``, waited for up to ``wait_s`` (they come at each party's next poll).

        Returns:
            (state, stack) by rank, of the ranks that answered in time.
        """
        pending, found = set(ranks), {}
        deadline = time.monotonic() + wait_s
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                if (raw := self._get_if_set(f"answer/{rank}")) is not None:
                    answer = json.loads(raw)
                    found[rank] = (RankState(**answer["state"]), answer["stack"])
                    pending.discard(rank)
            time.sleep(TIMINGS.recheck_s)
        return found

    def summarize(self, line: str, path: str) -> None:
        """The one line and the report's path, for the launchers."""
        self.store.set(SUMMARY, json.dumps({"reporter": self.party, "line": line, "path": path}))

    def summary(self) -> str | None:
        """The reporter's line, once it wrote one."""
        raw = self._get_if_set(SUMMARY)
        return json.loads(raw)["line"] if raw is not None else None

    def ack(self) -> None:
        self.store.set(f"ack/{self.party}", "1")

    def await_acks(self, parties: int, wait_s: float) -> None:
        """Wait until every other party has read the summary, or ``wait_s`` passed."""
        deadline = time.monotonic() + wait_s
        keys = [f"ack/{party}" for party in range(parties) if party != self.party]
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(TIMINGS.ack_recheck_s)


def watchdog_verdict(store: dist.Store | None) -> str | None:
    """The hang a rank's own HangWatchdog (``ddpkit train``, ``ddpkit.Run``) reported, in one line
    naming the late ranks and the report, from the keys it set in the ranks' store; None if none did.

    Args:
        store: the ranks' store as the launcher holds it (the keys sit under the process group's
            own prefix, which varies by launcher, then ``STORE_PREFIX``); None before a round.
    """
    if store is None:
        return None
    try:
        found = {
            name: k
            for k in store.list_keys()
            for name in (SUMMARY, REQUEST)
            if k.endswith(f"{STORE_PREFIX}/{name}")
        }
        if SUMMARY in found:
            return _verdict_line(json.loads(store.get(found[SUMMARY])))
        if REQUEST in found:  # the reporter died before it could say more
            reporter = int(store.get(found[REQUEST]))
            return f"rank {reporter}'s hang watchdog reported a hang; its report is above"
    except (RuntimeError, ValueError, KeyError):  # the store's host is gone: nothing to read
        pass
    return None


def _verdict_line(summary: dict) -> str:
    where = f"; the report is in {summary['path']}" if summary["path"] else ""
    # A desync is not slowness: the ranks wait in different collectives, so no timeout would ever
    # end it. Say what it is, not which timeout ran out.
    desync = summary["line"].startswith("desync")
    why = "" if desync else "a collective did not complete in time (the script's collective timeout): "
    return f"{why}{summary['line']}{where} (written by rank {summary['reporter']}, which waited)"
