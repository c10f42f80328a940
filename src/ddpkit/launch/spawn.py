"""The mp.spawn launcher: N processes on this machine, for notebooks, tests and small scripts.

Each child gets the same variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, ...), so a
function that calls ``ddpkit.init_distributed()`` runs unchanged under ``ddpkit run`` too.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from ddpkit.errors import ConfigError
from ddpkit.launch.ports import free_port


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


def launch(fn: Callable[..., Any], nproc: int, args: Sequence[Any] = ()) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` new processes and return what each rank returned.

    ``fn`` must be defined at module level (it is pickled into the children). When one child
    fails, the others are terminated within seconds and a ``LaunchError`` names the rank.

    Args:
        fn: the function each process runs; it calls ``ddpkit.init_distributed()`` itself.
        nproc: number of processes (ranks 0 .. nproc - 1).
        args: positional arguments passed to ``fn`` in every process.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc must be a positive integer, got {nproc!r}")
    with tempfile.TemporaryDirectory(prefix="ddpkit-launch-") as results:
        child_args = (fn, tuple(args), nproc, free_port(), results)
        try:
            mp.start_processes(_child, args=child_args, nprocs=nproc, join=True, start_method="spawn")
        except mp.ProcessRaisedException as exc:
            raise LaunchError(exc.error_index, _traceback_of(exc)) from None
        except mp.ProcessExitedException as exc:
            how = f"killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
            raise LaunchError(exc.error_index, how) from None
        return [_load_result(Path(results), rank) for rank in range(nproc)]


def _traceback_of(exc: mp.ProcessRaisedException) -> str:
    # torch prefixes the child's traceback with a banner line; keep only the traceback.
    text = str(exc)
    marker = "terminated with the following error:\n"
    return text.split(marker, 1)[-1].strip()


def _child(local_rank: int, fn: Callable[..., Any], args: tuple, nproc: int, port: int, results: str) -> None:
    # The launcher's job is to set these, exactly as torchrun does; dist/ reads them.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        DDPKIT_LAUNCHER="ddpkit",
    )
    result = fn(*args)
    with open(Path(results) / f"rank{local_rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def _load_result(results: Path, rank: int) -> Any:
    with open(results / f"rank{rank}.pkl", "rb") as f:
        return pickle.load(f)
