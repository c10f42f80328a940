"""``run.main_first()``: a block that rank 0 runs before the others, as Accelerate's
``main_process_first()``.

A ``datasets.map`` or a download writes a cache that the other ranks should read instead of
computing it again side by side. Rank 0 (with ``local=True``, each machine's local rank 0) runs
the block while the others wait in a barrier; it then enters the same barrier, which lets them
through to run the block themselves, finding its cache. One barrier over the whole world serves
both forms: it completes once every rank that goes first has finished its block.

The barrier is a collective on the default group, so the hang watchdog sees it: a rank that
never calls ``main_first`` (one under ``if run.is_main:``) is reported with the ranks that wait,
not left to hang. A block that runs longer than ``collective_timeout`` is reported the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.distributed as dist

from ddpkit.dist import DistEnv

WAIT = "main_first: waiting for the block of the rank that goes first (barrier)"
LEAD = "main_first: letting the other ranks into the block (barrier)"


@contextlib.contextmanager
def main_first(env: DistEnv, phase: Callable[[str], None], local: bool = False) -> Iterator[None]:
    """Run the block on the rank that goes first (global rank 0, or with ``local`` each machine's
    local rank 0), then on the others. Every rank enters it: it is a collective.

    Args:
        env: this process's distributed environment.
        phase: tells the hang watchdog the phase each rank waits in.
        local: the first process of each machine goes first (a cache on a disk of its own).
    """
    if env.world_size == 1:
        yield
        return
    first = env.is_local_rank0 if local else env.is_rank0
    if not first:
        phase(WAIT)
        dist.barrier()
    yield
    if first:  # not in a finally: a block that raised ends this rank, and the launcher the others
        phase(LEAD)
        dist.barrier()
