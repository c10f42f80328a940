"""The workers of a launcher forked from the test zygote, forked in turn from that launcher while
it is one thread, with torch and ddpkit imported (a fresh ``python -u SCRIPT`` spends seconds of
CPU importing them again).

torch's elastic agent starts each worker with ``Popen([python, -u, SCRIPT, ...],
start_new_session=True)`` after the rendezvous, when the launcher runs threads that make a fork
unsafe. So ``start_pool`` forks, before ``ddpkit.cli.main`` runs, one dormant child for each
worker the launch starts, and the agent's ``Popen`` hands one the worker's command line,
environment, folder and output files: it becomes the worker as a fresh interpreter would be
(``_become_worker``). Another command (``--no-python``, numactl), an environment that changes a
variable read while Python or torch start (``_READ_AT_START``), and a worker after the pool is
used up (a restart's) are started as torch starts them.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import types

# Variables read while Python, torch or numpy start (the forked worker would keep the launcher's
# value): a worker whose environment changes one of them is started as a fresh interpreter.
_READ_AT_START = re.compile(
    r"PYTHON(?!PATH$|UNBUFFERED$)|LD_|MALLOC|OMP_(?!NUM_THREADS$)|KMP_|GOMP_|MKL_|OPENBLAS_|NUMEXPR"
    r"|TORCH(?!ELASTIC_|_NCCL_|_DISABLE_SHARE_RDZV_TCP_STORE$|_DISTRIBUTED_DEBUG$)|PYTORCH|CUDA|NCCL|KINETO"
)
_pool: list[socket.socket] = []  # the launcher's ends of its dormant processes' sockets
_forked_env: dict[str, str] = {}  # the launcher's environment when it forked them
_site_path: list[str] = []  # sys.path entries a fresh interpreter has without PYTHONPATH


def start_pool(args: list[str], site_path: list[str]) -> None:
    """In a launcher forked from the zygote, before it starts any thread: fork one dormant worker
    for each worker the ``ddpkit run``/``train`` command ``args`` starts on this node, and route
    torch's worker start through them."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    _site_path[:] = site_path
    _forked_env.update(os.environ)
    launcher = os.getpid()
    if len(os.listdir("/proc/self/task")) != 1:
        return  # a fork beside another thread can copy a lock it holds: torch starts them afresh
    for _ in range(_workers_started(args)):
        mine, theirs = socket.socketpair()
        if os.fork() == 0:
            for conn in (mine, *_pool):  # the launcher's ends, of this one and those before
                conn.close()
            _dormant(theirs, launcher)  # never returns
        theirs.close()
        _pool.append(mine)
    original_popen, original_start = SubprocessHandler._popen, SubprocessContext._start

    def popen(handler, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        if _pool and _forkable(args, env):
            try:
                return _hand_out(_pool.pop(), args, env, handler._stdout, handler._stderr)
            except OSError:  # that dormant process is gone (killed): start this worker afresh
                pass
        return original_popen(handler, args, env)

    def start(context) -> None:
        original_start(context)
        while _pool:  # a dormant process not needed now: closing its socket ends it
            _pool.pop().close()

    SubprocessHandler._popen, SubprocessContext._start = popen, start


def _workers_started(args: list[str]) -> int:
    """``--nproc N`` of a ``run``/``train`` command (the cores for ``auto`` or none), else 0."""
    if not args or args[0] not in ("run", "train"):
        return 0
    value = "auto"
    for i, arg in enumerate(args):
        if arg == "--" or (args[0] == "run" and arg.endswith(".py")):
            break  # the script's own arguments follow
        name, _, inline = arg.partition("=")
        if name in ("--nproc", "--nproc-per-node", "--nproc_per_node"):
            value = inline or (args[i + 1] if i + 1 < len(args) else "")
    if value.isdigit():
        return int(value)
    return len(os.sched_getaffinity(0)) if value == "auto" else 0


def _forkable(args: tuple, env: dict[str, str]) -> bool:
    """``python -u SCRIPT ...`` or ``python -u -m MODULE ...`` whose command line and environment fit
    in this process's (``_shown``) and whose environment changes no variable read at start."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
        return False
    if args[2] != "-m" and not os.path.isfile(args[2]):
        return False
    arg_room, env_room = (end - start for start, end in _areas())
    if len(_cmdline(args)) > arg_room or len(_environ(env)) > env_room:
        return False
    changed = {k for k in set(env) | set(_forked_env) if env.get(k) != _forked_env.get(k)}
    return not any(_READ_AT_START.match(k) for k in changed)


def _areas() -> tuple[tuple[int, int], tuple[int, int]]:
    """(start, end) of this process's command-line and environment strings (/proc/self/stat)."""
    with open("/proc/self/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.read().rsplit(")", 1)[1].split()[45:49]]
    return (fields[0], fields[1]), (fields[2], fields[3])


def _cmdline(args) -> bytes:
    return b"".join(os.fsencode(str(a)) + b"\0" for a in args)


def _environ(env: dict[str, str]) -> bytes:
    return b"".join(os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items())


def _shown(args: list[str], env: dict[str, str]) -> None:
    """Write the worker's command line and environment over the zygote's, in place, for what
    reads /proc/PID/cmdline and /proc/PID/environ (ps, the tests that find workers by them).
    The zygote starts with room to spare in both; C's ``environ`` points elsewhere by now
    (``os.environ`` was rebuilt), and the command line starts with the same interpreter path."""
    import ctypes

    for (start, end), data in zip(_areas(), (_cmdline(args), _environ(env)), strict=True):
        ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)


def _hand_out(conn: socket.socket, args: tuple, env: dict[str, str], out, err) -> subprocess.Popen:
    request = {"args": [str(a) for a in args], "env": env, "cwd": os.getcwd()}
    fds = [(out or sys.stdout).fileno(), (err or sys.stderr).fileno()]
    socket.send_fds(conn, [json.dumps(request).encode()], fds)
    data = b""
    while len(data) < 4:  # its pid, sent once it leads a session of its own (torch kills by group)
        chunk = conn.recv(4 - len(data))
        if not chunk:
            raise ConnectionError("a dormant worker died before it started")
        data += chunk
    conn.close()
    return _Adopted(struct.unpack("!i", data)[0], list(args))


class _Adopted(subprocess.Popen):
    """A ``Popen`` for a child started another way: poll, wait and signals work on its pid."""

    def __init__(self, pid: int, args: list[str]) -> None:  # noqa: D107 (Popen.__init__ would start one)
        self.args, self.pid, self.returncode = args, pid, None
        self.stdin = self.stdout = self.stderr = None
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self._child_created = True
        self.text_mode = self.universal_newlines = False
        self.encoding = self.errors = None
        self.pipesize = -1


def _dormant(conn: socket.socket, launcher: int) -> None:
    """A forked child of the launcher: wait for a worker to become, or die with the launcher."""
    code = 1
    try:
        from ddpkit.launch.orphans import die_with_parent

        die_with_parent(expected_parent=launcher)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        if not message:
            os._exit(0)  # not needed: the launcher closed its end
        request = json.loads(message)
        os.setsid()  # as torch's Popen(start_new_session=True)
        for target, fd in zip((1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        conn.sendall(struct.pack("!i", os.getpid()))
        conn.close()
        code = _become_worker(request)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os._exit(code)


def _become_worker(request: dict) -> int:
    """``python -u SCRIPT ARGS`` or ``python -u -m MODULE ARGS`` in this process; its exit code."""
    args, env = request["args"], request["env"]
    argv = args[3:] if args[2] == "-m" else args[2:]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    _shown(args, env)
    _unbuffered_streams()
    sys.argv = list(argv)
    first = os.getcwd() if args[2] == "-m" else os.path.dirname(os.path.realpath(argv[0]))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *map(os.path.abspath, paths), *_site_path]
    sys.path_importer_cache.clear()
    tempfile.tempdir = None
    _fresh_process_state(env)
    _run_sitecustomize()  # the launcher's workerboot: it checks that its parent is the launcher
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    try:
        _run_main(args[3] if args[2] == "-m" else None, argv[0], main)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 (as the interpreter does: the hook, then 1)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # from the script's frame (or runpy's, as `python -m` shows them)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    _finalize()
    if code == -signal.SIGINT:  # Python ends by the signal after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _run_main(module: str | None, script: str, main: types.ModuleType) -> None:
    if module is not None:  # what `python -m MODULE` runs (it sets sys.argv[0] to the file)
        import runpy

        sys.modules.pop(module, None)  # preloaded here, not in a fresh interpreter (runpy warns)
        runpy._run_module_as_main(module)
        return
    main.__file__ = script
    with open(script, "rb") as f:
        source = f.read()
    exec(compile(source, script, "exec"), main.__dict__)


def _unbuffered_streams() -> None:
    """``-u``: writes reach the files at once."""
    for name, errors in (("stdout", "strict"), ("stderr", "backslashreplace")):
        stream = io.TextIOWrapper(
            io.FileIO(1 if name == "stdout" else 2, "w", closefd=False),
            encoding=getattr(sys, name).encoding,
            errors=errors,
            write_through=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_process_state(env: dict[str, str]) -> None:
    """What a fresh interpreter would have where the fork kept the launcher's: Python's signal
    dispositions, numpy's global generator and torch's seeded from the OS, the
    intra-op threads from OMP_NUM_THREADS. (Python's ``random`` reseeds itself after a fork.)"""
    import numpy as np
    import torch

    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    np.random.seed()
    torch.seed()
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _run_sitecustomize() -> None:
    """The first sitecustomize on the worker's sys.path, run as Python runs it at start-up."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path[1:])
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _finalize() -> None:
    """What the interpreter does at exit: join the non-daemon threads, run atexit, flush."""
    import atexit

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
