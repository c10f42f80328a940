"""Workers die with their launcher.

torchrun's agent starts each worker in a session of its own, so when the agent itself is killed
(SIGKILL from a scheduler, an OOM killer, a user's kill -9), the workers would run on as orphans:
still writing checkpoints, still holding GPUs. A worker calls ``die_with_parent()`` first thing
(``ddpkit train``'s worker does; under ``ddpkit run`` the launcher's sitecustomize does it for
any script); Linux then sends it SIGKILL the moment its parent goes away.

The kernel fires the signal when the *thread* that forked the worker exits, not the process. The
agent starts and restarts every worker from the one thread that runs it (the caller of
``run_elastic``, blocked there until the job ends), so that thread ends only with the launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only; elsewhere a no-op).

    Args:
        expected_parent: the launcher's pid. When given, a process whose parent is already
            another one (the launcher died while this process was starting) exits at once.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid() if expected_parent is None else expected_parent
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not fatal: the worker just keeps torchrun's default behaviour
    # The parent may have died before prctl took effect; then we are already an orphan.
    if os.getppid() != parent:
        os._exit(1)
