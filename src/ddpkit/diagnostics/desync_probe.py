"""The watchdog's desync probe: publish this rank's blocked collective, and compare every rank's.

State machine, driven by ``HangWatchdog`` once per poll (``tick``):

    quiet --(idle >= desync_s: one flight-recorder dump)--> latest collective completed: quiet
                                                        \\-> still in flight: blocked
    blocked: set ``record/RANK`` (what it waits in, and where), then ``blocked/RANK``; every
             ``check_s`` dump again (quiet once the collective completed), and when every
             rank's ``blocked/RANK`` is there (one ``check``), read the records: ``find_desync``.
    any state --(progress: a new collective or phase)--> quiet, ``blocked/RANK`` deleted

``record/RANK`` is overwritten, never deleted, so reading the records after the ``check`` never
waits for a key a rank deleted in between; a record a rank has since left behind is still one it
truly recorded, which ``find_desync`` tolerates (see ``desync.py``).

While the loop makes progress a tick costs one comparison; a dump is taken once per idle period of
``desync_s``, and the store is only touched while this rank is blocked in a collective.
"""

from __future__ import annotations

import logging
import time

from ddpkit.diagnostics.desync import Blocked, blocked_record, find_desync
from ddpkit.diagnostics.hang_exchange import BoundedStore
from ddpkit.diagnostics.stacks import flight_entries, user_frame

log = logging.getLogger(__name__)


def blocked_key(rank: int) -> str:
    return f"blocked/{rank}"


def record_key(rank: int) -> str:
    return f"record/{rank}"


class DesyncProbe:
    """One rank's side of desync detection (see the module docstring).

    Args:
        rank: this rank.
        world_size: number of ranks in the job.
        group_name: the default group's ``group_name``, whose flight-recorder entries count.
        desync_s: seconds idle, with the latest collective in flight, before this rank publishes
            itself as blocked and starts comparing.
        check_s: how often a blocked rank re-reads the flight recorder and the others' records.
        store: the watchdog's store.
        main_ident: the training thread, whose line the record names.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        group_name: str,
        desync_s: float,
        check_s: float,
        store: BoundedStore,
        main_ident: int,
    ) -> None:
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.desync_s, self.check_s = desync_s, check_s
        self.store, self.main_ident = store, main_ident
        self._probed = False  # the flight recorder was read in this idle period
        self._published: Blocked | None = None
        self._next_check = 0.0
        self._broken = False

    def tick(self, now: float, idle_s: float, progressed: bool) -> list[Blocked] | None:
        """Advance the probe; every rank's record when the ranks are in different collectives.

        Args:
            now: ``time.monotonic()``.
            idle_s: seconds since this rank's last progress.
            progressed: whether this poll saw progress (a new idle period starts).
        """
        if self._broken:
            return None
        try:
            return self._tick(now, idle_s, progressed)
        except Exception:  # a private recorder format or a stranger's record: keep the timeout alive
            log.exception("desync detection failed and is off; the collective timeout still applies")
            self._broken = True
            return None

    def _tick(self, now: float, idle_s: float, progressed: bool) -> list[Blocked] | None:
        if progressed:
            self.clear()
            self._probed, self._next_check = False, 0.0
        if idle_s < self.desync_s or (self._probed and self._published is None):
            return None  # busy, or idle with its latest collective completed: slow, not blocked
        if now < self._next_check:
            return None
        self._probed, self._next_check = True, now + self.check_s
        if not self._refresh(time.time() - idle_s):
            return None
        return self._compare()

    def _refresh(self, since_wall: float) -> bool:
        """Read the flight recorder; publish this rank's record, or delete it once completed."""
        record = blocked_record(flight_entries(self.group_name), self.rank, "", since_wall)
        if record is None:
            self.clear()
            return False
        if self._published is None:  # a new blocked collective (progress withdrew the last)
            # The user's line, read once per blocked collective: the stack walk needs the GIL.
            where = user_frame(self.main_ident)
            record = Blocked(record.rank, record.seq, record.op, record.ops, where, since_wall)
            self.store.call("set", record_key(self.rank), record.to_json())
            self._published = record
        self.store.call("set", blocked_key(self.rank), "1")  # again: a failed set must not stick
        return True

    def _compare(self) -> list[Blocked] | None:
        keys = [blocked_key(rank) for rank in range(self.world_size)]
        if not self.store.call("check", keys):  # one call, true only when every rank is blocked
            return None
        raws = self.store.call("multi_get", [record_key(rank) for rank in range(self.world_size)])
        if raws is None:
            return None
        records = {r.rank: r for r in map(Blocked.from_json, raws)}
        return find_desync(records, self.world_size)

    def clear(self) -> None:
        """Withdraw this rank's record (it made progress, its collective completed, or it stops)."""
        if self._published is not None:
            self.store.call("delete_key", blocked_key(self.rank))
            self._published = None
