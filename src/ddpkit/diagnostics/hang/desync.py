"""Desync detection: ranks blocked in different collectives, told apart from a merely slow rank.

Pure functions over flight-recorder entries and the records ranks publish, tested without
processes, and the probe that runs them on the watchdog thread (``DesyncProbe``).

The criterion. A correct program issues the same collective at every sequence number of a group
on every rank (the rule in docs/architecture.md). So when two ranks recorded *different*
collectives at the same sequence number of the default group, that is proof of a desync (a
collective only some ranks called, as in ``if rank == 0: run.save()``), whatever the timing. The
watchdog acts on it only when, besides, every rank has been idle for ``desync_s`` with its latest
collective still in flight: then no rank can bring the others forward.

Why a slow rank is never taken for one, twice over. (1) Not every rank is blocked: in a correct
program a collective completes once every rank has issued it, so while one rank computes (its
rank-0-only work, five minutes long), the ranks waiting for it wait in a collective it has not
issued yet, and its own latest collective has completed (or, were it ahead with one in flight, the
ranks behind would be computing, not waiting): it publishes no record. (2) No two records differ:
the waiting ranks all sit in the collective it will issue. A collective that is merely slow (a huge
all-reduce on a slow link, ranks one bucket apart) passes (1) but not (2). Both stay with the long
collective timeout.

The probe's states, driven by ``HangWatchdog`` once per poll (``tick``):

    quiet --(idle >= desync_s: one flight-recorder dump)--> latest collective completed: quiet
                                                        \\-> still in flight: blocked
    blocked: set ``record/RANK`` (what it waits in, and where), then ``blocked/RANK``; every
             ``check_s`` dump again (quiet once the collective completed), and when every
             rank's ``blocked/RANK`` is there (one ``check``), read the records: ``find_desync``.
    any state --(progress: a new collective or phase)--> quiet, ``blocked/RANK`` deleted

``record/RANK`` is overwritten, never deleted, so reading the records after the ``check`` never
waits for a key a rank deleted in between; a record a rank has since left behind is still one it
truly recorded, which ``find_desync`` tolerates. While the loop makes progress a tick costs one
comparison; a dump is taken once per idle period of ``desync_s``, and the store is only touched
while this rank is blocked in a collective.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from ddpkit.diagnostics.hang.boot_progress import flight_entries
from ddpkit.diagnostics.hang.exchange import BoundedStore
from ddpkit.diagnostics.hang.record import ranks_text
from ddpkit.diagnostics.hang.stacks import user_frame

log = logging.getLogger(__name__)

# Collectives whose tensors have the same shapes and dtypes on every rank of a correct program, so
# a difference there is a desync too (a rank-0-only metric all_reduce meeting the gradient one).
# Others (gather, scatter, all_to_all) may legitimately differ in shape between ranks.
SAME_SHAPES = frozenset({"all_reduce", "allreduce", "broadcast", "reduce", "allreduce_coalesced"})

FIX = (
    "every rank must call the same collectives in the same order: a collective under "
    "`if rank == 0:` (run.save(), run.evaluate(), a metric all_reduce) must run on every rank; "
    "keep only the printing and file writing inside the if"
)


@dataclass(frozen=True)
class Blocked:
    """One rank blocked in a collective, as it publishes itself once idle for ``desync_s``.

    Args:
        rank: global rank.
        seq: the sequence number of its latest collective on the default group (still in flight).
        op: that collective's signature (``signature``), e.g. ``"gloo:all_reduce(5 Float)"``.
        ops: signature of each recent collective it recorded, by sequence number (the latest included).
        where: ``file:line (source)`` of its main thread's innermost frame outside ddpkit, torch
            and the standard library: the user's line that called the collective.
        since_wall: ``time.time()`` of its last progress.
    """

    rank: int
    seq: int
    op: str
    ops: dict[int, str] = field(default_factory=dict)
    where: str = ""
    since_wall: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Blocked:
        raw = json.loads(text)
        raw["ops"] = {int(seq): op for seq, op in raw["ops"].items()}  # JSON keys are strings
        return cls(**raw)


def signature(entry: Mapping) -> str:
    """What must be equal on every rank for a flight-recorder entry: its op, and for ``SAME_SHAPES``
    ops its tensors' shapes and dtypes, e.g. ``"gloo:all_reduce(5 Float)"``."""
    name = str(entry.get("profiling_name", ""))
    if name.split(":")[-1] not in SAME_SHAPES:
        return name
    shapes = zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [], strict=False)
    tensors = [f"{'x'.join(map(str, size)) or 'scalar'} {dtype}" for size, dtype in shapes]
    return f"{name}({', '.join(tensors)})"


def blocked_record(
    entries: Sequence[Mapping], rank: int, where: str = "", since_wall: float = 0.0, keep: int = 16
) -> Blocked | None:
    """This rank's record when its latest collective is still in flight, else None.

    Args:
        entries: the flight recorder's collective entries of the default group, oldest first
            (``boot_progress.flight_entries``). For gloo, ``state`` stays ``"scheduled"`` whatever
            happens (torch 2.13); ``retired`` turns True when the collective completes.
        rank: this rank.
        where: the user's line its main thread is at.
        since_wall: ``time.time()`` of its last progress.
        keep: how many recent collectives to publish for comparison with ranks one or more ahead.
    """
    if not entries or entries[-1].get("retired", True):
        return None  # computing or waiting on something else: no collective of this group holds it
    recent = {int(e["collective_seq_id"]): signature(e) for e in entries[-keep:]}
    latest = int(entries[-1]["collective_seq_id"])
    return Blocked(rank, latest, recent[latest], recent, where, since_wall)


def find_desync(records: Mapping[int, Blocked], world_size: int) -> list[Blocked] | None:
    """Every rank's record when the ranks are blocked in different collectives, else None.

    Args:
        records: the records of the ranks that published one (blocked for ``desync_s``).
        world_size: number of ranks in the job.
    """
    if set(records) != set(range(world_size)):
        return None  # some rank is not blocked in a collective: slow, not desynchronized
    for a in records.values():
        for b in records.values():
            theirs = b.ops.get(a.seq) if a.seq <= b.seq else None
            if theirs is not None and theirs != a.op:
                return [records[r] for r in sorted(records)]
    return None


def desync_line(records: Sequence[Blocked]) -> str:
    """The desync in one line: which ranks are in which collective, and at which line of the script.

    For example: ``desync (a collective only some ranks called): rank 0 is in gloo:all_gather #23
    at train.py:21 (run.save()); rank 1 is in gloo:all_reduce(5 Float) #23 at train.py:18
    (run.backward(loss))``.
    """
    groups: dict[tuple[int, str, str], list[int]] = {}
    for record in sorted(records, key=lambda r: r.rank):
        groups.setdefault((record.seq, record.op, record.where), []).append(record.rank)
    parts = []
    for (seq, op, where), ranks in sorted(groups.items(), key=lambda item: item[1][0]):
        verb = "is" if len(ranks) == 1 else "are"
        parts.append(f"{ranks_text(ranks)} {verb} in {op} #{seq}" + (f" at {where}" if where else ""))
    return "desync (a collective only some ranks called): " + "; ".join(parts)


def desync_headline(records: Sequence[Blocked], desync_s: float) -> list[str]:
    """The first lines of a desync's hang report: the summary, how long, and the fix."""
    return [
        desync_line(records),
        f"every rank has waited over {desync_s:g} s in its collective (desync_timeout); {FIX}",
    ]


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
            self.store.set(f"record/{self.rank}", record.to_json())
            self._published = record
        self.store.set(f"blocked/{self.rank}", "1")  # again: a failed set must not stick
        return True

    def _compare(self) -> list[Blocked] | None:
        keys = [f"blocked/{rank}" for rank in range(self.world_size)]
        if not self.store.check(keys):  # one call, true only when every rank is blocked
            return None
        raws = self.store.multi_get([f"record/{rank}" for rank in range(self.world_size)])
        if raws is None:
            return None
        records = {r.rank: r for r in map(Blocked.from_json, raws)}
        return find_desync(records, self.world_size)

    def clear(self) -> None:
        """Withdraw this rank's record (it made progress, its collective completed, or it stops)."""
        if self._published is not None:
            self.store.delete_key(f"blocked/{self.rank}")
            self._published = None
