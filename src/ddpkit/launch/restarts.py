"""One line when the elastic agent restarts the workers: who failed first, how, and which restart.

torch's agent restarts a failed round silently: what shows is the surviving rank's traceback
(``Connection reset by peer``, the victim's, not the culprit's) and its own log line ``failed
(exitcode: -9) local_rank: 1 (pid: N) of binary: ...``, which names the round's first failure
by time. ``RestartLine`` catches that record (the agent logs it at ERROR, which passes torch's
default WARNING level) and, when the next round begins, prints::

    ddpkit: restart 1 of 3: local rank 1 (pid 4242) on host-a failed first (exit code -9:
    killed by signal SIGKILL); the workers start again: a ddpkit.Run script resumes from its
    newest checkpoint, any other script from its own start

Ranks that failed later in the same round (a peer's consequence) are not named.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # where torch logs the first failure


class RestartLine(logging.Handler):
    """Remembers the last round's first failure; ``on_round`` prints the line for a restart.

    Args:
        max_restarts: ``--max-restarts``: how many restarts the agent may make.
    """

    def __init__(self, max_restarts: int) -> None:
        super().__init__(level=logging.ERROR)
        self.max_restarts = max_restarts
        self.failure: tuple | None = None  # (exit code, local rank, pid) of the round's first failure

    def install(self) -> RestartLine:
        logging.getLogger(AGENT_LOGGER).addHandler(self)
        return self

    def uninstall(self) -> None:
        logging.getLogger(AGENT_LOGGER).removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if (
            isinstance(record.msg, str)
            and record.msg.startswith("failed (exitcode")
            and len(record.args) >= 3
        ):
            self.failure = tuple(record.args[:3])

    def on_round(self, generation: int) -> None:
        """A new round of workers begins (generation 1 is the first): after a failure, say so."""
        if generation < 2 or self.failure is None:
            return
        exitcode, local_rank, pid = self.failure
        self.failure = None
        print(
            f"ddpkit: restart {generation - 1} of {self.max_restarts}: local rank {local_rank} (pid {pid}) "
            f"on {socket.gethostname()} failed first ({describe(exitcode)}); the workers start again: a "
            "ddpkit.Run script resumes from its newest checkpoint, any other script from its own start",
            file=sys.stderr,
            flush=True,
        )


def describe(exitcode: object) -> str:
    """``exit code -9: killed by signal SIGKILL``, or ``exit code 1``."""
    if isinstance(exitcode, int) and exitcode < 0:
        try:
            return f"exit code {exitcode}: killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exit code {exitcode}"
