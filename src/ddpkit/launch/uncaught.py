"""How a process where ddpkit started a run ends on an uncaught exception: a ConfigError is one line.

``install_excepthook`` makes ``report`` the process's excepthook. Importing ddpkit does not:
what starts a run or a launcher calls it (the ``ddpkit.Run`` constructor, the ``ddpkit``
command, ``ddpkit.launch`` and its children, the ``ddpkit train`` worker), so a user's own
script gets it under any launcher (torchrun, srun, plain ``python``) once it makes a Run. A
``ConfigError`` (a bad value from the user) prints ``ddpkit: error: MESSAGE``, no traceback,
and exits with code 2; every other exception keeps its traceback (the hook before ours prints it).

Several ranks often raise the same ConfigError (a global batch that does not split raises on
every rank), and one rank's error makes its peers fail in their next collective. So the ranks
agree through the job's store (``ddpkit.dist.job_store``):

- a rank with a ConfigError marks it in the store; rank 0 prints its line; any other rank waits
  up to ``MARK_WAIT_S`` for rank 0's mark and prints its own line (naming its rank) only without one;
- a rank whose collective failed because a peer left prints nothing when a peer marked one.

Without a store (the agent gone, no process group) each rank with a ConfigError prints its line.
Under ``ddpkit run`` the worker's start-up hook (``launch/workerboot``) reports instead: the
workers print nothing and the launcher prints the one line.
"""

from __future__ import annotations

import io
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ddpkit.dist import read_launcher_vars
from ddpkit.dist.init import job_store
from ddpkit.errors import USER_ERROR, ConfigError
from ddpkit.launch.boot_errors import is_peer_failure
from ddpkit.launch.no_gpu import no_gpu_line

MARK = "ddpkit/config-error/"  # + rank: that rank raised a ConfigError (the value: its message)
ANY_MARK = "ddpkit/config-errors"  # how many ranks did
# Ranks that raise the same ConfigError reach it within moments of each other (the collective
# before it lined them up); a rank alone with its error waits this long before saying it.
MARK_WAIT_S = 5.0


def install_excepthook() -> None:
    """Make ``report`` this process's ``sys.excepthook``, in front of the one it had.

    Idempotent: a second call (a second Run, a launcher inside the CLI) leaves the hook as it is.
    """
    if getattr(sys.excepthook, "ddpkit_one_line", False):
        return
    previous = sys.excepthook

    def excepthook(kind, exc, tb):
        return report(kind, exc, tb, previous)

    excepthook.ddpkit_one_line = True
    sys.excepthook = excepthook


def report(kind: type[BaseException], exc: BaseException, tb, previous) -> None:
    """``sys.excepthook``: a ConfigError as one line from one rank, a peer's consequence quietly,
    everything else by ``previous`` (a traceback)."""
    boot = sys.modules.get("ddpkit_worker_boot")
    if getattr(boot, "WORKER", False):  # a ddpkit run worker: its start-up hook reports
        return previous(kind, exc, tb)
    if issubclass(kind, ConfigError):
        _config_error(exc)
    if (line := no_gpu_line(exc, tb)) is not None:
        _config_error(ConfigError(line))
    if is_peer_failure(exc) and _peer_marked():
        raise SystemExit(1)  # a peer's ConfigError ended this collective; its line says why
    return previous(kind, exc, tb)


def _config_error(exc: BaseException) -> None:
    rank, world, store = _job()
    if store is not None:
        try:
            store.set(f"{MARK}{rank}", str(exc))
            store.add(ANY_MARK, 1)
            if rank != 0 and _marked_in_time(store, f"{MARK}0"):
                raise SystemExit(USER_ERROR)  # rank 0 raised one too, and says it
        except SystemExit:
            raise
        except Exception:  # no store after all: say it here
            pass
    where = f"rank {rank}: " if world > 1 and rank != 0 else ""
    stream = _stderr()
    stream.write(f"ddpkit: error: {where}{exc}\n")
    stream.flush()
    # SystemExit out of an excepthook: CPython's PyErr_Print exits with its code, after atexit.
    raise SystemExit(USER_ERROR)


def _marked_in_time(store: dist.Store, key: str) -> bool:
    # Polled with check(): a store.wait that times out logs two lines of C++ warnings.
    deadline = time.monotonic() + MARK_WAIT_S
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _peer_marked() -> bool:
    _, _, store = _job()
    try:
        return store is not None and store.check([ANY_MARK])
    except Exception:
        return False


def _job() -> tuple[int, int, dist.Store | None]:
    """(rank, world size, the job's store or None for a world of one)."""
    try:
        if dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            found = read_launcher_vars()
            rank, world = found.rank, found.world_size
    except Exception:  # bad launcher variables: this process speaks for itself
        return 0, 1, None
    return rank, world, job_store(timedelta(seconds=MARK_WAIT_S)) if world > 1 else None


def _stderr():
    # torch's init_process_group wraps the excepthook to prefix each line with the rank: it
    # swaps sys.stderr for a StringIO and writes that out after the inner hook returns, which
    # ours never does (SystemExit carries exit code 2), so the line goes to the real stderr.
    captured = isinstance(sys.stderr, io.StringIO) and sys.__stderr__ is not None
    return sys.__stderr__ if captured else sys.stderr
