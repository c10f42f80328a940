"""A worker's uncaught exception, told to its launcher: the boot hook's excepthook calls this.

It is also written to torchelastic's error file, as ``@record`` would, so the launcher names it.
A ddpkit ``ConfigError`` is not printed: the worker leaves its message in
``RUN_DIR/config-error-RANK`` and exits with code 2, and the launcher prints it as one line
(``failures.py``); a rank whose collective failed because such a peer left exits quietly too.

Standard library only at the top: ``workerboot/sitecustomize.py`` loads this file by its path at
the first uncaught exception, when ddpkit may not be imported.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# + rank: the message of that rank's ConfigError; failures.py reads it, and the launcher removes it
# before a restart (elastic.py, through the hang monitor).
CONFIG_ERROR = "config-error-"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")
# How long a rank whose collective failed because a peer died waits before it records its own
# failure: torch's agent polls its workers every 0.1 s and names the failure with the earliest
# timestamp, in whole seconds, so an error file written at once can claim the same second as the
# peer's death, or an earlier one, and the restart line then names this rank instead of the cause.
# Three seconds, not one: on a loaded machine the agent's poll lags (a 2-core run under load once
# named the rank that saw its peer go, instead of the one killed). The agent stops this rank as
# soon as it sees the dead one, so the wait is cut short whenever the cause is on this node.
PEER_WAIT_S = 3.0


def is_peer_failure(exc: BaseException) -> bool:
    """True for errors that mean another rank failed first (its collective partner disappeared)."""
    # torch.distributed is loaded wherever one of its errors was raised.
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    return (dist_error is not None and isinstance(exc, dist_error)) or mentions_peer_gone(str(exc))


def mentions_peer_gone(text: str) -> bool:
    """True when an error text says the other end of a collective went away."""
    return any(marker in text for marker in PEER_GONE)


def on_uncaught(previous, run_dir: str, rank: str, exc_type, exc, tb) -> None:
    """Record the exception, then leave a one-line error to the launcher or hand it to ``previous``.

    Args:
        previous: the excepthook this one replaced.
        run_dir: the launcher's run directory.
        rank: this worker's global rank.
        exc_type: as ``sys.excepthook`` gets them.
        exc: as ``sys.excepthook`` gets them.
        tb: as ``sys.excepthook`` gets them.
    """
    if is_peer_failure(exc):
        time.sleep(PEER_WAIT_S)  # the agent sees the peer's death first, and stops this rank
    _write_error_file(exc_type, exc, tb)
    marker = os.path.join(run_dir, f"{CONFIG_ERROR}{rank}")
    if _is_config_error(exc_type) and _write_whole(marker, str(exc)):
        raise SystemExit(2)  # from an excepthook: Python runs atexit, then exits with 2
    no_gpu = _no_gpu_line(exc, tb)
    if no_gpu is not None and _write_whole(marker, no_gpu):
        raise SystemExit(2)  # a script asking for CUDA where there is none: one line too
    if _after_peer_config_error(exc, run_dir, rank):
        raise SystemExit(1)
    previous(exc_type, exc, tb)


def _write_error_file(exc_type, exc, tb) -> None:
    """torchelastic's error file, in ``@record``'s format, unless ``@record`` wrote it first."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    callstack = "".join(traceback.format_exception(exc_type, exc, tb))
    info = {"py_callstack": callstack, "timestamp": str(int(time.time()))}
    # Written whole, then renamed: the agent may stop this worker mid-write (its peer died first),
    # and it reads the file with json.load, which an empty file crashes.
    _write_whole(path, json.dumps({"message": {"message": f"{exc_type.__name__}: {exc}", "extraInfo": info}}))


def _no_gpu_line(exc, tb) -> str | None:
    try:  # imported only now: torch, which raised, is loaded; ddpkit may not be
        from ddpkit.launch.no_gpu import no_gpu_line
    except ImportError:
        return None
    return no_gpu_line(exc, tb)


def _is_config_error(exc_type) -> bool:
    config_error = getattr(sys.modules.get("ddpkit.errors"), "ConfigError", None)
    return config_error is not None and issubclass(exc_type, config_error)


def _write_whole(path: str, text: str) -> bool:
    """``text`` to ``path`` through a temporary file and a rename, so no reader (the launcher, the
    agent) sees half of it; False when it cannot be written."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        return True
    except OSError:
        return False  # the traceback still reaches stderr


def _after_peer_config_error(exc, run_dir: str, rank: str) -> bool:
    """True for a collective that failed because a peer on this node left with a ConfigError."""
    try:
        mine = f"{CONFIG_ERROR}{rank}"
        names = os.listdir(run_dir)
        if not any(n.startswith(CONFIG_ERROR) and n != mine and not n.endswith(".tmp") for n in names):
            return False
        return is_peer_failure(exc)
    except Exception:
        return False
