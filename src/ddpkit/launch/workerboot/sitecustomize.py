"""Start-up of every worker of a ``ddpkit run`` job, with no change to the user's script.

The launcher puts this folder first on the workers' PYTHONPATH, so Python imports this module
while it starts, before the script. Only the worker process itself (the elastic agent's child,
``DDPKIT_AGENT_PID``, which it takes out of its environment) is changed; its own children
(DataLoader workers, a script's subprocesses) just pass through. In the worker:

- it dies with its launcher: ``PR_SET_PDEATHSIG`` (``ddpkit/launch/orphans.py``), also while
  it is still starting;
- ``faulthandler`` writes every thread's Python stack to ``RUN_DIR/stacks-RANK.txt`` when the
  launcher sends ``DDPKIT_STACK_SIGNAL`` (the hang report), and to ``RUN_DIR/exit-RANK.txt`` when
  the agent stops it with SIGTERM (where the others were when a rank failed). faulthandler's
  handler runs in C, so it answers while the main thread waits inside a collective;
- with ``DDPKIT_PROGRESS_S`` set, a daemon thread writes the default process group's collective
  sequence number to ``RUN_DIR/progress-RANK`` when it changes (one read of a counter and at
  most one small write per period);
- an uncaught exception is also written to torchelastic's error file, as ``@record`` would, so
  the launcher names it. A ddpkit ``ConfigError`` is not printed: the worker leaves its message in
  ``RUN_DIR/config-error-RANK`` and exits with code 2, and the launcher prints it as one line; a
  rank whose collective failed because such a peer left exits quietly too.

Then a sitecustomize of the user's own, further along sys.path, is run as Python would have.
Only the standard library is imported here: every Python process of the job pays for it.
"""

from __future__ import annotations

import faulthandler
import importlib.machinery
import importlib.util
import json
import os
import signal
import sys
import threading
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
_kept: list = []  # files faulthandler writes to: they must outlive this module's functions
_progress: list = []  # [(run_dir, rank, period_s), stop event, thread] of the progress thread
WORKER = False  # True in a worker the launcher started (not in its descendants)


def _die_with_agent(agent_pid: int) -> None:
    # orphans.py by its path: importing the ddpkit package would import torch into every process.
    path = os.path.join(os.path.dirname(_HERE), "orphans.py")
    spec = importlib.util.spec_from_file_location("_ddpkit_orphans", path)
    orphans = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(orphans)
    orphans.die_with_parent(expected_parent=agent_pid)


def _register_stacks(run_dir: str, rank: str) -> None:
    on_request = open(os.path.join(run_dir, f"stacks-{rank}.txt"), "w")  # noqa: SIM115
    on_exit = open(os.path.join(run_dir, f"exit-{rank}.txt"), "w")  # noqa: SIM115
    _kept.extend([on_request, on_exit])
    stack_signal = int(os.environ["DDPKIT_STACK_SIGNAL"])
    faulthandler.register(stack_signal, file=on_request, all_threads=True, chain=False)
    # chain=True: after the dump, SIGTERM does what it did before (ends the process). A script
    # that installs its own SIGTERM handler replaces this one, and keeps its behaviour.
    faulthandler.register(signal.SIGTERM, file=on_exit, all_threads=True, chain=True)
    # A forked child (a DataLoader worker) inherits the handlers and the files; its stacks are not
    # the rank's, and an unhandled real-time signal would kill it: give it the defaults back.
    os.register_at_fork(after_in_child=lambda: _unregister(stack_signal))


def _unregister(stack_signal: int) -> None:
    faulthandler.unregister(stack_signal)
    faulthandler.unregister(signal.SIGTERM)


def _default_group():
    """The default process group, or None (not created yet, torch half-imported, being destroyed)."""
    c10d = getattr(sys.modules.get("torch.distributed"), "distributed_c10d", None)
    try:
        return c10d._get_default_group() if c10d is not None and c10d.is_initialized() else None
    except Exception:
        return None


def _sequence_number(group) -> int:
    """The group's collective count; -1 without a group."""
    try:
        return group._get_sequence_number_for_group() if group is not None else -1
    except Exception:
        return -1


def _group_timeout_s(group) -> float:
    """The timeout the script gave its process group (torch's default unless it chose one); 0 if unknown."""
    try:
        return group._get_backend(group._device_types[0]).options._timeout.total_seconds()
    except Exception:  # private API: without it the launcher falls back to torch's default
        return 0.0


def _watch_progress(path: str, period_s: float, stop: threading.Event) -> None:
    """Write ``PID SEQ WALL LEFT WORLD TIMEOUT`` whenever the sequence number changes, in one
    fixed-size record.

    ``LEFT`` is 1 once the group is gone after it existed (``destroy_process_group``); ``SEQ``
    then keeps its last value. ``TIMEOUT`` is the group's own timeout, in seconds. ``os.pwrite``
    on a raw descriptor takes no Python lock, so a fork in the main thread (a DataLoader starting
    workers) never copies a lock this thread holds.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    world, last, record, timeout = os.environ.get("WORLD_SIZE", "0"), None, -1, 0.0
    while True:
        group = _default_group()
        seq = _sequence_number(group)
        if seq >= 0 and record < 0:
            timeout = _group_timeout_s(group)
        record = seq if seq >= 0 else record
        now = (record, record >= 0 and seq < 0)  # (the last count seen, whether the group is gone)
        # Hold no reference to the group while sleeping: one kept after destroy_process_group()
        # lives until interpreter shutdown, where its gloo threads abort the process (SIGABRT,
        # "terminate called without an active exception") after a run that ended well.
        group = None
        if now != last:
            last = now
            line = f"{os.getpid()} {record} {time.time():.3f} {int(now[1])} {world} {timeout:.0f}"
            os.pwrite(fd, line.ljust(63).encode() + b"\n", 0)
        if stop.wait(period_s):
            break
    os.close(fd)


def _start_progress(run_dir: str, rank: str, period_s: float) -> None:
    stop = threading.Event()
    path = os.path.join(run_dir, f"progress-{rank}")
    thread = threading.Thread(
        target=_watch_progress, args=(path, period_s, stop), name="ddpkit-progress", daemon=True
    )
    thread.start()
    _progress[:] = [(run_dir, rank, period_s), stop, thread]


def pause_progress() -> None:
    """Stop the progress thread (at exit; and to measure what it costs, beside ``resume_progress``)."""
    if _progress:
        _, stop, thread = _progress
        stop.set()
        thread.join(timeout=2 * _progress[0][2])


def resume_progress() -> None:
    """Start the progress thread again after ``pause_progress``."""
    if _progress and not _progress[2].is_alive():
        _start_progress(*_progress[0])


def _record_uncaught(previous, run_dir: str, rank: str):
    """An excepthook that also writes torchelastic's error file, in ``@record``'s format, and
    leaves a ConfigError (and a peer's consequence of one) to the launcher to print."""

    def hook(exc_type, exc, tb):
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path and not os.path.exists(path):  # @record, where the script has it, wrote first
            callstack = "".join(traceback.format_exception(exc_type, exc, tb))
            info = {"py_callstack": callstack, "timestamp": str(int(time.time()))}
            # Written whole, then renamed: the agent may stop this worker mid-write (its peer died
            # first), and it reads the file with json.load, which an empty file crashes.
            message = {"message": {"message": f"{exc_type.__name__}: {exc}", "extraInfo": info}}
            _write_whole(path, json.dumps(message))
        marker = os.path.join(run_dir, f"{CONFIG_ERROR}{rank}")
        if _is_config_error(exc_type) and _write_whole(marker, str(exc)):
            raise SystemExit(2)  # from an excepthook: Python runs atexit, then exits with 2
        no_gpu = _no_gpu_line(exc, tb)
        if no_gpu is not None and _write_whole(marker, no_gpu):
            raise SystemExit(2)  # a script asking for CUDA where there is none: one line too
        if _after_peer_config_error(exc, run_dir, rank):
            raise SystemExit(1)
        previous(exc_type, exc, tb)

    return hook


CONFIG_ERROR = "config-error-"  # + rank: the message of that rank's ConfigError (failures.py reads it)


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
        from ddpkit.launch.failures import is_peer_failure  # at the error: torch is loaded by now

        return is_peer_failure(exc)
    except Exception:
        return False


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
    _die_with_agent(int(agent))
    run_dir, rank = env["DDPKIT_RUN_DIR"], env["RANK"]
    _register_stacks(run_dir, rank)
    try:  # a restarted worker: its previous attempt's ConfigError is no longer news
        os.unlink(os.path.join(run_dir, f"{CONFIG_ERROR}{rank}"))
    except OSError:
        pass
    sys.excepthook = _record_uncaught(sys.excepthook, run_dir, rank)
    global WORKER
    WORKER = True  # ddpkit.launch.uncaught leaves this worker's uncaught exceptions to the hook above
    if float(env.get("DDPKIT_PROGRESS_S", "0")) > 0:
        _start_progress(run_dir, rank, float(env["DDPKIT_PROGRESS_S"]))
        # Stop before interpreter shutdown tears torch down under the thread: threading's own
        # at-exit hooks run before atexit's, while the main thread's modules are still alive.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(pause_progress)


try:
    _main()
except Exception as exc:  # never keep a script from starting
    print(f"ddpkit: worker diagnostics unavailable: {exc!r}", file=sys.stderr)
sys.modules["ddpkit_worker_boot"] = sys.modules[__name__]  # a user's sitecustomize takes the name
_run_user_sitecustomize()
