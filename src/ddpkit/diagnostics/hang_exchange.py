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
calls return None rather than block, a launcher through a ``DirectStore``, whose failures raise.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.diagnostics.hang_state import RankState
from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)

STORE_PREFIX = "ddpkit/hang"
STORE_TIMEOUT_S = 5.0
RUN_PREFIX = "ddpkit/run"
REPORTER, REQUEST, SUMMARY = "reporter", "request", "summary"


def state_key(rank: int) -> str:
    return f"state/{rank}"


def answer_key(rank: int) -> str:
    return f"answer/{rank}"


def own_client(store: dist.Store, timeout_s: float = STORE_TIMEOUT_S) -> dist.Store:
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


def watchdog_store() -> dist.Store:
    """The watchdog's own client of the default group's store."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("HangWatchdog needs a process group: call ddpkit.init_distributed() first")
    return own_client(dist.distributed_c10d._get_default_store())


class BoundedStore:
    """Store calls that give up after ``timeout_s`` instead of blocking the caller forever.

    In torch 2.13 a TCPStore ``check`` on a store host frozen by SIGSTOP (rank 0 under
    ``ddpkit.launch``) waits for the reply forever: the store's timeout bounds ``get`` and
    ``wait``, not every call. So calls run on one daemon worker thread and the caller waits at
    most ``timeout_s``; while an earlier call is still stuck on that worker, every call fails at
    once. Failures return None.

    Args:
        store: the store to call, prefixed with ``STORE_PREFIX``.
        timeout_s: how long one call may take.
    """

    def __init__(self, store: dist.Store, timeout_s: float = STORE_TIMEOUT_S) -> None:
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


class DirectStore:
    """The launcher's store under ``RUN_PREFIX``, called as a ``BoundedStore`` is; failures raise."""

    def __init__(self, store: dist.Store) -> None:
        self.store = dist.PrefixStore(RUN_PREFIX, store)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.store, method)(*args)


class Exchange:
    """One party's side of the conversation.

    Args:
        store: a watchdog's ``BoundedStore``, or a launcher's ``DirectStore``.
        party: this rank (a watchdog) or this node (a launcher).
    """

    def __init__(self, store: BoundedStore | DirectStore, party: int) -> None:
        self.store, self.party = store, party
        self.answered = False  # this party answered a request, or made it

    def _get_if_set(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it is not set; never waits for it to appear."""
        return self.store.call("get", key) if self.store.call("check", [key]) else None

    def publish(self, state: RankState) -> None:
        self.store.call("set", state_key(state.rank), state.to_json())

    def asked(self) -> bool:
        """True the first time this party sees a reporter's request, which it must answer."""
        if self.answered or not self.store.call("check", [REQUEST]):
            return False
        self.answered = True
        return True

    def answer(self, state: RankState, stack: str) -> None:
        payload = {"state": asdict(state), "stack": stack}
        self.store.call("set", answer_key(state.rank), json.dumps(payload))

    def claim(self) -> int | None:
        """1 when this rank is the reporter; more when another rank is; None: no store."""
        return self.store.call("add", REPORTER, 1)

    def reporter(self) -> int | None:
        """The reporting party, from ``request``; None when it cannot be read."""
        raw = self.store.call("get", REQUEST)
        return int(raw) if raw else None

    def states(self, ranks: Iterable[int]) -> dict[int, RankState]:
        """The last published state of each of ``ranks`` that published one."""
        raws = {rank: self._get_if_set(state_key(rank)) for rank in ranks}
        return {rank: RankState.from_json(raw) for rank, raw in raws.items() if raw is not None}

    def request(self) -> None:
        """The reporter asks every other party for its ranks' answers."""
        self.answered = True
        self.store.call("set", REQUEST, str(self.party))

    def answers(self, ranks: Iterable[int], wait_s: float, poll_s: float) -> dict[int, tuple[RankState, str]]:
        """The answers of ``ranks``, waited for up to ``wait_s`` (they come at each party's next poll).

        Returns:
            (state, stack) by rank, of the ranks that answered in time.
        """
        pending, found = set(ranks), {}
        deadline = time.monotonic() + wait_s
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                if (raw := self._get_if_set(answer_key(rank))) is not None:
                    answer = json.loads(raw)
                    found[rank] = (RankState(**answer["state"]), answer["stack"])
                    pending.discard(rank)
            time.sleep(min(0.1, poll_s))
        return found

    def summarize(self, line: str, path: str) -> None:
        """The one line and the report's path, for the launchers."""
        self.store.call("set", SUMMARY, json.dumps({"reporter": self.party, "line": line, "path": path}))

    def summary(self) -> str | None:
        """The reporter's line, once it wrote one."""
        raw = self._get_if_set(SUMMARY)
        return json.loads(raw)["line"] if raw is not None else None

    def ack(self) -> None:
        self.store.call("set", f"ack/{self.party}", "1")

    def await_acks(self, parties: int, wait_s: float) -> None:
        """Wait until every other party has read the summary, or ``wait_s`` passed."""
        deadline = time.monotonic() + wait_s
        keys = [f"ack/{party}" for party in range(parties) if party != self.party]
        while not self.store.call("check", keys) and time.monotonic() < deadline:
            time.sleep(0.2)


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
