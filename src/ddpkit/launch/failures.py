"""What a failed job reports: which rank failed first, and why.

When one rank fails, its peers fail soon after with "connection closed by peer" from gloo (or a
similar NCCL error), and a launcher may notice a peer first. Both launchers therefore report the
earliest failure that is not such a consequence.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ddpkit.diagnostics.hang.report import DUMP_STACKS
from ddpkit.errors import ConfigError
from ddpkit.launch.boot_errors import CONFIG_ERROR, mentions_peer_gone


class LaunchError(RuntimeError):
    """A child process failed; the others were stopped.

    Args:
        rank: the rank that failed first.
        detail: its traceback, or how it exited (code or signal).
    """

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank = rank
        self.detail = detail


class WorkerFailure(RuntimeError):
    """A worker of an elastic job failed.

    Args:
        rank: global rank of the first failure.
        exitcode: its exit code (negative: killed by a signal).
        detail: the traceback the worker recorded, or how it exited.
        headline: the whole message instead of "rank R failed (exit code C): detail" (a hang).
    """

    def __init__(self, rank: int, exitcode: int, detail: str, headline: str = "") -> None:
        super().__init__(headline or f"rank {rank} failed (exit code {exitcode}): {detail}")
        self.rank, self.exitcode, self.detail = rank, exitcode, detail

    @classmethod
    def from_child_failed(
        cls, exc: ChildFailedError, hang: str | None = None, others: Path | None = None
    ) -> WorkerFailure:
        """The failure to report, from the agent's error and what the launcher knows.

        Args:
            exc: the agent's error, with every failed worker's exit code and recorded error.
            hang: the launcher's own evidence of a hang (its monitor's verdict, or the rank whose
                watchdog reported one); an exit code alone never means a hang, as any script may
                exit with any code.
            others: a file with the other ranks' stacks at the time of the failure.
        """
        rank, failure = _root_failure(exc)
        where = f"\nwhere the other ranks were: {others}" if others is not None else ""
        if hang is not None:
            return cls(rank, failure.exitcode, hang, headline=hang)
        if failure.exitcode < 0:
            detail = f"killed by signal {failure.signal_name()}"
        elif isinstance(failure.message, dict):
            # Written by @record, or by ddpkit run's worker start-up for an uncaught exception:
            # {"message": ..., "extraInfo": {"py_callstack": ...}}
            info = failure.message.get("extraInfo", {})
            detail = info.get("py_callstack") or failure.message.get("message", "no message")
            if (network := network_cause(detail)) is not None:
                detail = f"{network}\n{detail.strip()}"
        else:
            detail = "see the worker's output above for its traceback"
        return cls(rank, failure.exitcode, detail.strip() + where)


# gloo's words for a connection that could not be made or was lost, most telling first. The peer
# is on the same line as [ADDR]:PORT, after the words ("... Connection refused, remote=[10.0.0.2]:4242",
# "Connection closed by peer [10.0.0.2]:4242") or before them ("Read error [10.0.0.2]:4242:
# Connection reset by peer").
NETWORK_ERRORS = (
    "No route to host",
    "Network is unreachable",
    "Connection refused",
    "Connection timed out",
    "Connection reset by peer",
    "Connection closed by peer",
    "timed out connecting",
)
PEER_ADDRESS = re.compile(r"\[([^\]]+)\]:(\d+)")


def network_cause(text: str) -> str | None:
    """One line naming the unreachable peer, from a gloo error in ``text``; None if there is none."""
    lines = text.splitlines()
    for why in NETWORK_ERRORS:
        for line in (line for line in lines if why in line):
            # The address nearest the words: gloo's own "[file.cc:152]" holds no port-like pair.
            if found := PEER_ADDRESS.findall(line):
                addr, port = found[-1]
                return (
                    f"network: the peer at {addr}:{port} was unreachable ({why}): its process is gone, "
                    "or the network between the two hosts is cut"
                )
    return None


def _root_failure(exc: ChildFailedError) -> tuple[int, ProcessFailure]:
    by_time = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)
    causes = [item for item in by_time if not mentions_peer_gone(str(item[1].message))]
    return (causes or by_time)[0]


def write_exit_stacks(run_dir: Path) -> Path | None:
    """Write ``RUN_DIR/failure-report.txt``: where this node's other ranks were when the agent
    stopped them after a failure (each one's SIGTERM dump); None when none left a dump.
    """
    dumps = {}
    for path in sorted(run_dir.glob("exit-*.txt")):
        text = path.read_text(errors="replace")
        if text.strip():
            dumps[int(path.stem.split("-")[1])] = text
    if not dumps:
        return None
    lines = ["ddpkit failure report: the stacks of the ranks the agent stopped after a rank failed", ""]
    for rank in sorted(dumps):
        lines += [DUMP_STACKS.format(rank), dumps[rank].rstrip(), ""]
    report = run_dir / "failure-report.txt"
    report.write_text("\n".join(lines))
    return report


# A `ddpkit run` worker that raised a ConfigError leaves its message in RUN_DIR/CONFIG_ERROR + RANK
# (launch/boot_errors.py) and prints nothing; the launcher prints it once.


def user_error(run_dir: Path) -> ConfigError | None:
    """The ConfigError a worker of this node raised: rank 0's if it did, else the lowest rank's."""
    found = {}
    for path in run_dir.glob(f"{CONFIG_ERROR}*"):
        rank = path.name[len(CONFIG_ERROR) :]
        if rank.isdigit():
            found[int(rank)] = path.read_text(encoding="utf-8", errors="replace")
    return ConfigError(found[min(found)]) if found else None


@contextlib.contextmanager
def quiet_after_user_error(run_dir: Path) -> Iterator[None]:
    """Without torch's lines about stopping the other workers and the first one's exit code, once
    a worker has left a ConfigError: the launcher's one line says what went wrong."""
    quiet = _QuietAfterUserError(run_dir)
    TORCH_PROCS_LOG.addFilter(quiet)
    try:
        yield
    finally:
        TORCH_PROCS_LOG.removeFilter(quiet)


TORCH_PROCS_LOG = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
TORCH_STOPPING = ("failed (exitcode", "Sending process")  # its lines as the other workers are stopped


class _QuietAfterUserError(logging.Filter):
    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.run_dir = run_dir

    def filter(self, record: logging.LogRecord) -> bool:
        stopping = isinstance(record.msg, str) and record.msg.startswith(TORCH_STOPPING)
        return not (stopping and any(self.run_dir.glob(f"{CONFIG_ERROR}*")))
