"""A worker's stacks for its launcher, through faulthandler: the boot hook registers them.

``faulthandler`` writes every thread's Python stack to ``RUN_DIR/stacks-RANK.txt`` when the
launcher sends ``DDPKIT_STACK_SIGNAL`` (the hang report, ``workerview.dump_stacks``), and to
``RUN_DIR/exit-RANK.txt`` when the agent stops the worker with SIGTERM (where the others were when
a rank failed, ``failures.write_exit_stacks``). Its handler runs in C, so it answers while the
main thread waits inside a collective.

Standard library only: ``workerboot/sitecustomize.py`` loads this file by its path in every
worker, before the script, and importing the ddpkit package would import torch.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import IO


def register_stacks(run_dir: str, rank: str, stack_signal: int) -> list[IO]:
    """Register the two dumps; returns the files, which the caller must keep open.

    Args:
        run_dir: the launcher's run directory.
        rank: this worker's global rank.
        stack_signal: the signal the launcher sends for a dump (``workerview.STACK_SIGNAL``).
    """
    on_request = open(os.path.join(run_dir, f"stacks-{rank}.txt"), "w")  # noqa: SIM115
    on_exit = open(os.path.join(run_dir, f"exit-{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(stack_signal, file=on_request, all_threads=True, chain=False)
    # chain=True: after the dump, SIGTERM does what it did before (ends the process). A script
    # that installs its own SIGTERM handler replaces this one, and keeps its behaviour.
    faulthandler.register(signal.SIGTERM, file=on_exit, all_threads=True, chain=True)
    # A forked child (a DataLoader worker) inherits the handlers and the files; its stacks are not
    # the rank's, and an unhandled real-time signal would kill it: give it the defaults back.
    os.register_at_fork(after_in_child=lambda: _unregister(stack_signal))
    return [on_request, on_exit]


def _unregister(stack_signal: int) -> None:
    faulthandler.unregister(stack_signal)
    faulthandler.unregister(signal.SIGTERM)
