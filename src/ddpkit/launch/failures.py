"""What a failed job reports: which rank failed first, and why.

When one rank fails, its peers fail soon after with "connection closed by peer" from gloo (or a
similar NCCL error), and a launcher may notice a peer first. Both launchers therefore report the
earliest failure that is not such a consequence.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ddpkit.diagnostics.hang import HANG_EXIT_CODE

# What gloo and NCCL say when the other end of a collective went away: a consequence, not a cause.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")


def is_peer_failure(exc: BaseException) -> bool:
    """True for errors that mean another rank failed first (its collective partner disappeared)."""
    return isinstance(exc, dist.DistError) or mentions_peer_gone(str(exc))


def mentions_peer_gone(text: str) -> bool:
    """True when an error text says the other end of a collective went away."""
    return any(marker in text for marker in PEER_GONE)


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
    """

    def __init__(self, rank: int, exitcode: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed (exit code {exitcode}): {detail}")
        self.rank, self.exitcode, self.detail = rank, exitcode, detail

    @classmethod
    def from_child_failed(cls, exc: ChildFailedError) -> WorkerFailure:
        rank, failure = _root_failure(exc)
        if failure.exitcode < 0:
            detail = f"killed by signal {failure.signal_name()}"
        elif failure.exitcode == HANG_EXIT_CODE:
            detail = (
                "a collective did not complete in time; see the hang report above (and OUT/hang-report.txt)"
            )
        elif isinstance(failure.message, dict):
            # Written by @record in the worker: {"message": ..., "extraInfo": {"py_callstack": ...}}
            info = failure.message.get("extraInfo", {})
            detail = info.get("py_callstack") or failure.message.get("message", "no message")
        else:
            detail = "see the worker's output above for its traceback"
        return cls(rank, failure.exitcode, detail.strip())


def _root_failure(exc: ChildFailedError) -> tuple[int, ProcessFailure]:
    by_time = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)
    causes = [item for item in by_time if not mentions_peer_gone(str(item[1].message))]
    return (causes or by_time)[0]
