"""One line when the elastic agent restarts the workers: who failed first, how, and which restart.

torch's agent restarts a failed round silently: what shows is the surviving rank's traceback
(``Connection reset by peer``, the victim's, not the culprit's) and its own log line ``failed
(exitcode: -9) local_rank: 1 (pid: N) of binary: ...``, which names the round's first failure
by time. ``RestartLine`` catches that record (the agent logs it at ERROR, which passes torch's
default WARNING level) and, when the next round begins, prints::

    ddpkit: restart 1 of 3: local rank 1 (pid 4242) on host-a failed first (exit code -9:
    killed by signal SIGKILL); the workers resume from step 40 (/runs/a/checkpoints/step-40)

Ranks that failed later in the same round (a peer's consequence) are not named. Where the
workers go on from: a ``ddpkit.Run`` notes its OUT in the run directory (``note_out``, from each
node's local rank 0), and the newest checkpoint there is chosen as the Run will choose it, from
manifests and sizes; without a note, the script is not a Run and starts over. The same restart
goes to OUT/events.jsonl, which ``ddpkit report`` shows.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from ddpkit.checkpoint.choose import newest_good
from ddpkit.checkpoint.manifest import step_of
from ddpkit.checkpoint.store import CheckpointError

AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # where torch logs the first failure
OUT_NOTE = "run-out"  # in the run directory: the OUT of the Run the workers run
EVENTS = "events.jsonl"  # in OUT: the run's restarts


def note_out(out: Path) -> None:
    """In a worker under ``ddpkit run``/``ddpkit train`` (each node's local rank 0): note the
    Run's OUT for the launcher, which reads where a restart resumes from there."""
    run_dir = os.environ.get("DDPKIT_RUN_DIR")
    if run_dir and os.environ.get("LOCAL_RANK", "0") == "0" and Path(run_dir).is_dir():
        (Path(run_dir) / OUT_NOTE).write_text(str(Path(out).resolve()), encoding="utf-8")


def restart_point(run_dir: Path) -> tuple[str, Path | None, int | None]:
    """Where restarted workers go on from: (words for the line, OUT or None, step or None)."""
    note = run_dir / OUT_NOTE
    if not note.is_file():
        return "no ddpkit checkpoint: the script starts over", None, None
    out = Path(note.read_text(encoding="utf-8"))
    try:
        found = newest_good(out / "checkpoints", verify=False)
    except CheckpointError:
        found = None
    if found is None:
        return f"no checkpoint in {out} yet: the run starts at step 0", out, 0
    step = step_of(found)
    return f"the workers resume from step {step} ({found})", out, step


class RestartLine(logging.Handler):
    """Remembers the last round's first failure; ``on_round`` prints the line for a restart.

    Args:
        max_restarts: ``--max-restarts``: how many restarts the agent may make.
    """

    def __init__(self, max_restarts: int, run_dir: Path) -> None:
        super().__init__(level=logging.ERROR)
        self.max_restarts, self.run_dir = max_restarts, run_dir
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
        host, number = socket.gethostname(), generation - 1
        where, out, step = restart_point(self.run_dir)
        print(
            f"ddpkit: restart {number} of {self.max_restarts}: local rank {local_rank} (pid {pid}) "
            f"on {host} failed first ({describe(exitcode)}); {where}",
            file=sys.stderr,
            flush=True,
        )
        if out is not None and out.is_dir():
            event = {"event": "restart", "restart": number, "of": self.max_restarts, "step": step}
            event |= {"local_rank": local_rank, "host": host, "why": describe(exitcode), "time": time.time()}
            with open(out / EVENTS, "a", encoding="utf-8") as f:
                f.write(json.dumps(event) + "\n")


def describe(exitcode: object) -> str:
    """``exit code -9: killed by signal SIGKILL``, or ``exit code 1``."""
    if isinstance(exitcode, int) and exitcode < 0:
        try:
            return f"exit code {exitcode}: killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exit code {exitcode}"
