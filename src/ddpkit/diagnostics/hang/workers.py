"""What a launcher sees of its own workers: progress files, /proc, and faulthandler's stack dumps.

The files live in the run directory the launcher made; the workers' boot hook writes them
(``launch/workerboot/sitecustomize.py``, with ``boot_progress.py``). Nothing here touches the
workers but a signal.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from ddpkit.diagnostics.hang.boot_progress import STACK_SIGNAL, THREAD_FUNCTION
from ddpkit.diagnostics.hang.record import Progress, RankState, outside_state
from ddpkit.diagnostics.hang.timings import TIMINGS

# /proc/PID/stat's state letter, as the report says it.
PROC_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in the kernel (D)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped",
}


def read_progress(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Each local rank's last ``progress-RANK`` record (``PID SEQ WALL LEFT WORLD TIMEOUT``,
    ``boot_progress.py``), as ``RankState`` fields; a file caught mid-write is read again at the
    next poll."""
    found = {}
    for path in run_dir.glob("progress-*"):
        try:
            pid, seq, _, left, world, timeout = path.read_text().split()
            found[int(path.name.split("-")[1])] = dict(
                pid=int(pid), seq=int(seq), left=left == "1", world=int(world), group_timeout_s=float(timeout)
            )
        except (OSError, ValueError):
            continue
    return found


def proc_stat(pid: int) -> tuple[str, float, int] | None:
    """(state letter, CPU seconds used, parent pid) of a live process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return fields[0], (int(fields[11]) + int(fields[12])) / ticks, int(fields[1])


def is_our_worker(pid: int) -> bool:
    """True for a live child of this process: a pid read from a file could be reused by now."""
    stat = proc_stat(pid)
    return stat is not None and stat[2] == os.getpid()


class WorkerProgress:
    """The collector outside the process: this node's workers' ``RankState`` from their progress
    files and /proc, with when each last progressed and the CPU it used since."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.host = socket.gethostname()
        self._since: dict[tuple[int, int], Progress] = {}  # (rank, pid) -> when it last progressed

    def reset(self) -> None:
        self._since.clear()

    def states(self) -> dict[int, RankState]:
        now_mono, now_wall = time.monotonic(), time.time()
        return {
            rank: self._state(rank, progress, now_mono, now_wall)
            for rank, progress in read_progress(self.run_dir).items()
        }

    def _state(self, rank: int, progress: dict[str, Any], now_mono: float, now_wall: float) -> RankState:
        pid = progress["pid"]
        stat = proc_stat(pid) if is_our_worker(pid) else None
        cpu = stat[1] if stat else 0.0
        # A restarted worker is another process: its progress starts afresh.
        since = self._since.setdefault((rank, pid), Progress(now_mono, cpu))
        since.observe(progress["seq"], None, now_mono, cpu)
        return outside_state(
            idle_s=since.idle(now_mono),
            heard_wall=now_wall,
            rank=rank,
            host=self.host,
            cpu_s=max(0.0, cpu - since.cpu_s),
            proc=PROC_STATES.get(stat[0], stat[0]) if stat else "exited",
            **progress,
        )

    def pids(self) -> dict[int, int]:
        """rank -> pid of each local worker that is still our child."""
        return {r: p["pid"] for r, p in read_progress(self.run_dir).items() if is_our_worker(p["pid"])}


def dump_stacks(run_dir: Path, pids: dict[int, int], wait_s: float = TIMINGS.dump_wait_s) -> dict[int, str]:
    """Every thread's stack of each local rank, through faulthandler; or why there is none.

    Args:
        run_dir: where the workers' ``stacks-RANK.txt`` files are.
        pids: rank -> pid of the local workers (only ones that registered the handler: it is
            registered before their progress file exists, and the signal would kill others).
        wait_s: how long to wait for the dumps.
    """
    sizes, stacks = {}, {}
    for rank, pid in pids.items():
        path = run_dir / f"stacks-{rank}.txt"
        sizes[rank] = path.stat().st_size if path.exists() else 0
        stat = proc_stat(pid)
        if stat is not None and stat[0] in "Tt":
            stacks[rank] = "(no stack: the process is stopped (SIGSTOP); it answers after SIGCONT)"
            continue
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            stacks[rank] = "(no stack: the process has exited)"
    deadline = time.monotonic() + wait_s
    pending = set(pids) - set(stacks)
    while pending and time.monotonic() < deadline:
        time.sleep(TIMINGS.recheck_s)
        for rank in sorted(pending):
            text = _grown(run_dir / f"stacks-{rank}.txt", sizes[rank])
            if text is not None:
                stacks[rank] = text
                pending.discard(rank)
    stacks = {rank: _without_own_threads(text) for rank, text in stacks.items()}
    for rank in pending:
        stacks[rank] = f"(no stack within {wait_s:g} s: it may be in the kernel, or blocking signals)"
    return stacks


def _without_own_threads(dump: str) -> str:
    """faulthandler's dump less the thread of ddpkit's boot hook, which is never the story."""
    blocks = dump.strip("\n").split("\n\n")
    return "\n\n".join(b for b in blocks if f"in {THREAD_FUNCTION}" not in b) + "\n"


def _grown(path: Path, since: int) -> str | None:
    """The text added to ``path`` after offset ``since``, once the dump has stopped growing."""
    with open(path, "rb") as f:
        f.seek(since)
        added = f.read()
    # faulthandler writes a dump in many small writes: take it once one short wait adds nothing.
    time.sleep(TIMINGS.dump_settle_s)
    if not added or path.stat().st_size != since + len(added):
        return None
    return added.decode(errors="replace")
