"""Start-up of every worker of a ``ddpkit run`` job, with no change to the user's script.

The launcher puts this folder first on the workers' PYTHONPATH, so Python imports this module
while it starts, before the script. Only the worker process itself (the elastic agent's child,
``DDPKIT_AGENT_PID``, which it takes out of its environment) is changed; its own children
(DataLoader workers, a script's subprocesses) just pass through. In the worker, each job is a
module of ddpkit:

- it dies with its launcher, also while it is still starting (``launch/orphans.py``);
- faulthandler dumps its stacks when the launcher asks, and at SIGTERM, and with
  ``DDPKIT_PROGRESS_S`` set a thread writes its collective count
  (``diagnostics/hang/boot_progress.py``; the hang system's files and variables:
  ``diagnostics/hang/__init__.py``);
- an uncaught exception reaches the launcher (``launch/boot_errors.py``, loaded at the first one).

Then a sitecustomize of the user's own, further along sys.path, is run as Python would have.
Every Python process of the job pays for this module, so it imports only the standard library and
loads those modules by their path: importing the ddpkit package would import torch.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))  # ddpkit/
_kept: list = []  # files faulthandler writes to: they must outlive this module's functions
_progress: list = []  # the ProgressWriter, once started
_BOOT_PROGRESS = "diagnostics/hang/boot_progress"
WORKER = False  # True in a worker the launcher started (not in its descendants)


def _load(path: str):
    """``ddpkit/PATH.py``, loaded by its path (as ``_ddpkit_NAME``) without the ddpkit package."""
    key = f"_ddpkit_{os.path.basename(path)}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(_PACKAGE, f"{path}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def pause_progress() -> None:
    """Stop the progress thread (at exit; and to measure what it costs, beside ``resume_progress``)."""
    if _progress:
        _progress[0].pause()


def resume_progress() -> None:
    """Start the progress thread again after ``pause_progress``."""
    if _progress:
        _progress[0].resume()


def _start_progress(run_dir: str, rank: str, period_s: float) -> None:
    _progress[:] = [_load(_BOOT_PROGRESS).ProgressWriter(run_dir, rank, period_s)]
    resume_progress()
    # Stop before interpreter shutdown tears torch down under the thread: threading's own at-exit
    # hooks run before atexit's, while the main thread's modules are still alive.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(pause_progress)


def _excepthook(previous, run_dir: str, rank: str):
    def hook(exc_type, exc, tb):
        _load("launch/boot_errors").on_uncaught(previous, run_dir, rank, exc_type, exc, tb)

    return hook


def _run_user_sitecustomize() -> None:
    """Python imports only the first sitecustomize on sys.path; run the one this one hid."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


def _main() -> None:
    env = os.environ
    # Taken out of the environment, so that this worker's own children (which inherit it) are
    # not taken for workers; a worker whose launcher already died has another parent, and exits.
    agent = env.pop("DDPKIT_AGENT_PID", None)
    if agent is None or "RANK" not in env:
        return  # not a worker the launcher started: a descendant, or a process outside ddpkit run
    _load("launch/orphans").die_with_parent(expected_parent=int(agent))
    run_dir, rank = env["DDPKIT_RUN_DIR"], env["RANK"]
    _kept.extend(_load(_BOOT_PROGRESS).register_stacks(run_dir, rank))
    sys.excepthook = _excepthook(sys.excepthook, run_dir, rank)
    global WORKER
    WORKER = True  # ddpkit.launch.uncaught leaves this worker's uncaught exceptions to the hook above
    if float(env.get("DDPKIT_PROGRESS_S", "0")) > 0:
        _start_progress(run_dir, rank, float(env["DDPKIT_PROGRESS_S"]))


try:
    _main()
except Exception as exc:  # never keep a script from starting
    print(f"ddpkit: worker diagnostics unavailable: {exc!r}", file=sys.stderr)
sys.modules["ddpkit_worker_boot"] = sys.modules[__name__]  # a user's sitecustomize takes the name
_run_user_sitecustomize()
