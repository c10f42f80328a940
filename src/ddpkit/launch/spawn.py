"""The in-process launcher: N processes on this machine, for notebooks, tests and small scripts.

Each child gets the same variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, ...), so a
function that calls ``ddpkit.init_distributed()`` runs unchanged under ``ddpkit run`` too. The
children are spawned, or forked when ``fn`` comes from a notebook cell (``start_method.py``);
``ranks.py`` starts them, waits, and stops them on SIGINT or SIGTERM.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from ddpkit.diagnostics.hang.exchange import watchdog_verdict
from ddpkit.errors import ConfigError
from ddpkit.launch.boot_errors import is_peer_failure
from ddpkit.launch.failures import LaunchError
from ddpkit.launch.ranks import LocalRanks, enter_rank
from ddpkit.launch.start_method import FORKSERVER
from ddpkit.launch.start_method import start_method as choose_method
from ddpkit.launch.stores import LOOPBACK, bound_store
from ddpkit.launch.uncaught import install_excepthook

STORE_TIMEOUT_S = 300.0  # for this process's own client of the store, which it never uses


def launch(
    fn: Callable[..., Any], nproc: int, args: Sequence[Any] = (), start_method: str | None = None
) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` new processes and return what each rank returned.

    ``fn`` is defined at module level of an importable file (the children are spawned and import
    it), or in a notebook cell or another ``__main__`` without a file (the children are forked;
    then CUDA must not be initialized in this process yet). When one child fails, the others are
    terminated within seconds and a ``LaunchError`` names the rank. SIGINT (Ctrl-C, a kernel
    interrupt) or SIGTERM goes to every child; a ``ddpkit.Run`` finishes its step and checkpoints
    it, what still runs 30 s later is killed, and ``KeyboardInterrupt`` (SIGINT) or ``SystemExit``
    (SIGTERM) says what became of each child.

    Args:
        fn: the function each process runs; it calls ``ddpkit.init_distributed()`` itself.
        nproc: number of processes (ranks 0 .. nproc - 1).
        args: positional arguments passed to ``fn`` in every process.
        start_method: None (spawn, or fork for a notebook's function), or ``"spawn"``, ``"fork"``
            or ``"forkserver"``: one server with torch and ddpkit imported forks the processes of
            every launch from this process, each in milliseconds (start_method.py).
    """
    install_excepthook()  # the caller's script: a ConfigError it leaves uncaught is one line
    if not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc must be a positive integer, got {nproc!r}")
    method = choose_method(fn, args, start_method)
    # This process hosts the ranks' store, on loopback alone: a TCPStore rank 0 opened itself would
    # listen on every interface, and it has no authentication (see ddpkit.launch.stores).
    store = bound_store(LOOPBACK, 0, STORE_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="ddpkit-launch-") as results:
        # A forkserver's processes are its children, and have its environment and folder: they
        # are handed the launcher's, as spawn's get them.
        here = (dict(os.environ), os.getcwd()) if method == FORKSERVER else None
        child_args = (fn, tuple(args), nproc, store.port, results, os.getpid(), here)
        try:
            LocalRanks(_child, child_args, nproc, method).run()
        except mp.ProcessRaisedException as exc:
            rank, detail = _first_failure(Path(results), exc)
            raise LaunchError(rank, detail) from None
        except mp.ProcessExitedException as exc:
            how = f"killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
            if (hang := watchdog_verdict(store)) is not None:  # evidence, not the exit code
                how += f", after a hang report: {hang}"
            raise LaunchError(exc.error_index, how) from None
        return [_load_result(Path(results), rank) for rank in range(nproc)]


def _first_failure(results: Path, exc: mp.ProcessRaisedException) -> tuple[int, str]:
    """The rank whose failure caused the others.

    When one rank raises, its peers soon fail too ("connection closed by peer" in gloo) and torch
    may notice a peer first; a failing rank's own ``finally: destroy()`` can even make the peers
    fail before it records its error. So the cause is the earliest failure that is not a peer
    failure (see ``is_peer_failure``); only if all are, the earliest of those.
    """
    failures = []
    for path in results.glob("failure-rank*.pkl"):
        with open(path, "rb") as f:
            failures.append(pickle.load(f))
    if not failures:
        # torch prefixes the child's traceback with a banner line; keep only the traceback.
        return exc.error_index, str(exc).split("terminated with the following error:\n", 1)[-1].strip()
    _, _, rank, detail = min(failures)
    return rank, detail


def _child(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple,
    nproc: int,
    port: int,
    results: str,
    launcher: int,
    here: tuple[dict, str] | None,
) -> None:
    if (
        here is not None
    ):  # forked by a forkserver, which dies with the launcher: the launcher's env and folder
        os.environ.clear()
        os.environ.update(here[0])
        os.chdir(here[1])
    enter_rank(launcher if here is None else None, nproc)
    install_excepthook()  # a fresh interpreter (spawn): a run starts here
    # The launcher's job is to set these, exactly as torchrun does; dist/ reads them.
    os.environ.update(
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        DDPKIT_LAUNCHER="ddpkit",
        # The store is the launcher's: every rank, rank 0 too, connects to it as a client (torch's
        # env:// rendezvous and ddpkit's init_distributed both read this).
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    try:
        result = fn(*args)
    except BaseException as exc:
        consequence = is_peer_failure(exc)
        failure = (consequence, time.time(), local_rank, traceback.format_exc().strip())
        _write(Path(results) / f"failure-rank{local_rank}.pkl", failure)
        raise
    _write(Path(results) / f"rank{local_rank}.pkl", result)


def _write(path: Path, value: Any) -> None:
    """Whole or not at all: a rank stopped mid-write (SIGTERM once a peer failed) leaves no
    truncated file for the launcher to read (it once raised EOFError instead of the LaunchError)."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        pickle.dump(value, f)
    os.replace(part, path)


def _load_result(results: Path, rank: int) -> Any:
    with open(results / f"rank{rank}.pkl", "rb") as f:
        return pickle.load(f)
