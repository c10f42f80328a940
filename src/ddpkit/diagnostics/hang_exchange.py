"""What the ranks' hang watchdogs say to each other through the store, key by key.

The keys, under ``hang_store.STORE_PREFIX`` (the launchers read ``summary`` and ``request`` through
``watchdog_verdict`` below, so this file alone knows them):

    state/RANK   each rank: its progress (a ``RankState``), whenever it changes.
    reporter     a counter: the rank whose ``add`` makes it 1 writes the report.
    request      the reporter's rank: every other rank answers it once.
    answer/RANK  the answer: the rank's fresh state and its training thread's stack.
    summary      the reporter's one-line attribution and the report's path.

Every call goes through a ``BoundedStore``: a store that does not answer makes a call return
None (nothing published, nothing found) rather than block the watchdog.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import torch.distributed as dist

from ddpkit.diagnostics.hang_state import RankState
from ddpkit.diagnostics.hang_store import STORE_PREFIX, BoundedStore

REPORTER, REQUEST, SUMMARY = "reporter", "request", "summary"


def state_key(rank: int) -> str:
    return f"state/{rank}"


def answer_key(rank: int) -> str:
    return f"answer/{rank}"


class Exchange:
    """One rank's side of the conversation.

    Args:
        store: the watchdog's bounded store.
        rank: this rank.
        world_size: how many ranks take part.
    """

    def __init__(self, store: BoundedStore, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    def publish(self, state: RankState) -> None:
        self.store.call("set", state_key(self.rank), state.to_json())

    def requested(self) -> bool:
        """True once a reporter asked every rank for its answer."""
        return bool(self.store.call("check", [REQUEST]))

    def answer(self, state: RankState, stack: str) -> None:
        payload = {"state": asdict(state), "stack": stack}
        self.store.call("set", answer_key(self.rank), json.dumps(payload))

    def claim(self) -> int | None:
        """1 when this rank is the reporter; more when another rank is; None: no store."""
        return self.store.call("add", REPORTER, 1)

    def reporter(self) -> int | None:
        """The reporting rank, from ``request``; None when it cannot be read."""
        raw = self.store.call("get", REQUEST)
        return int(raw) if raw else None

    def gather(self, state: RankState, stack: str, answer_s: float, poll_s: float) -> tuple[dict, dict]:
        """The reporter's round: ask every rank, wait up to ``answer_s`` for the answers (they come
        at each rank's next poll), and take the last published state of a rank that did not answer.

        Returns:
            (states, stacks) by rank, this rank's own included; a silent rank has no stack.
        """
        self.store.call("set", REQUEST, str(self.rank))
        states, stacks = {self.rank: state}, {self.rank: stack}
        for rank, answer in self._answers(answer_s, poll_s).items():
            states[rank], stacks[rank] = RankState(**answer["state"]), answer["stack"]
        for rank in set(range(self.world_size)) - set(states):
            if (raw := self.store.get_if_set(state_key(rank))) is not None:
                states[rank] = RankState.from_json(raw)
        return states, stacks

    def _answers(self, answer_s: float, poll_s: float) -> dict[int, dict]:
        pending, found = set(range(self.world_size)) - {self.rank}, {}
        deadline = time.monotonic() + answer_s
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                if (raw := self.store.get_if_set(answer_key(rank))) is not None:
                    found[rank] = json.loads(raw)
                    pending.discard(rank)
            time.sleep(min(0.1, poll_s))
        return found

    def summarize(self, line: str, path: str) -> None:
        """The one line and the report's path, for the launcher."""
        self.store.call("set", SUMMARY, json.dumps({"reporter": self.rank, "line": line, "path": path}))


def watchdog_verdict(store: dist.Store) -> str | None:
    """The hang a rank's own HangWatchdog (``ddpkit train``, ``ddpkit.Run``) reported, in one line
    naming the late ranks and the report, from the keys it set in the ranks' store; None if none did.

    Args:
        store: the ranks' store as the launcher holds it (the keys sit under the process group's
            own prefix, which varies by launcher, then ``STORE_PREFIX``).
    """
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
