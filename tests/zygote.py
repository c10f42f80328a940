"""`python -m ddpkit ARGS` for the tests, started in milliseconds: forked from a server that has
torch and ddpkit's launcher imported once (about 1.7 CPU-seconds of imports a launch otherwise).

The server is this file run as a script, one per test process, started at the first call of
``run`` and ended with the test process (it exits once its parent is gone). Each call sends the
command's arguments, environment and folder, and its output files' descriptors, over a Unix
socket; the server forks, and the child becomes the launcher: its own process, with its own pid,
whose workers are its children. Its workers are forked from it in turn, before it starts a
thread (tests/zygote_workers.py), and handed to torch's elastic agent; a restart's workers are
fresh interpreters. ``ddpkit check``'s trials are forked from the server too. Tests of what a
launcher's process is (its signals, its session, its parent) start it themselves with
subprocess.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zygote_workers

NAME = "ddpkit-test-zygote"  # in the server's command line: conftest's leftover check skips it
ROOM = "DDPKIT_TEST_ZYGOTE_ROOM"


def _serve(path: str) -> None:
    os.environ.pop(ROOM)
    pythonpath = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    site_path = [p for p in sys.path[1:] if os.path.abspath(p) not in pythonpath]
    import ddpkit  # noqa: F401  (the imports every launch and its workers share, done once)
    import ddpkit.cli  # noqa: F401
    import ddpkit.launch.elastic  # noqa: F401
    import ddpkit.train.command  # noqa: F401

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    server.settimeout(1.0)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test process is gone
                os._exit(0)
            continue
        conn.settimeout(None)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            _become(request, fds, functools.partial(_start_workers, request["args"], site_path, path))
        for fd in fds:
            os.close(fd)
        conn.sendall(struct.pack("!i", pid))
        threading.Thread(target=_report_exit, args=(conn, pid), daemon=True).start()


def _start_workers(args: list[str], site_path: list[str], path: str) -> None:
    """In a forked launcher, while it is one thread: its workers-to-be (tests/zygote_workers.py);
    in ``ddpkit check``, each trial's launcher is forked from this server too."""
    zygote_workers.start_pool(args, site_path)
    if args[:1] == ["check"]:
        _route_trials(path)


def _route_trials(path: str) -> None:
    """``ddpkit check`` starts each trial as ``subprocess.run([python, -m, ddpkit, run, ...],
    stdout=LOG, stderr=STDOUT, env=ENV)``; here that command is run by this server as ``run``
    runs one (its launcher forked, its workers forked from the launcher), its output in LOG."""
    import ddpkit.check.trials as trials

    global _server
    _server = _Attached(path)

    class Subprocess:  # the module ``trials`` calls subprocess.run through
        def __getattr__(self, name: str):
            return getattr(subprocess, name)

        @staticmethod
        def run(command, stdout=None, stderr=None, env=None, **kwargs):
            if command[:3] == [sys.executable, "-m", "ddpkit"] and stderr == subprocess.STDOUT and not kwargs:
                return run(command[3:], env=env, log=Path(stdout.name))
            return subprocess.run(command, stdout=stdout, stderr=stderr, env=env, **kwargs)

    trials.subprocess = Subprocess()


def _report_exit(conn: socket.socket, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)  # -N for a signal, as subprocess says
    try:
        conn.sendall(struct.pack("!i", code))
    finally:
        conn.close()


def _become(request: dict, fds: list[int], start_workers) -> None:
    """In the forked child: the launcher the request describes, then exit with its code (never
    returns). ``start_workers`` forks its workers-to-be while it is one thread."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request["session"]:
            os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter has
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.executable, *request["args"]]
        sys.path[0] = request["cwd"]  # as `python -m` puts it first
        try:
            start_workers()
            import ddpkit.cli

            code = ddpkit.cli.main(request["args"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 (as the interpreter would: the hook, then exit 1)
            sys.excepthook(*sys.exc_info())
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code if isinstance(code, int) else 1)


class _Server:
    """This test process's server, started at the first launch."""

    def __init__(self) -> None:
        self.path = tempfile.mktemp(prefix="ddpkit-zygote-", suffix=".sock", dir="/tmp")
        # Room for a worker's command line and environment, written over the server's
        # (tests/zygote_workers.py): a long last argument, a long variable the server drops.
        command = [sys.executable, __file__, self.path, NAME, "-" * 8192]
        env = {**os.environ, ROOM: "-" * 120_000}
        self.proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout.readline().strip() == "ready", "the test zygote did not start"


class _Attached:
    """The server, as seen from a process it forked."""

    def __init__(self, path: str) -> None:
        self.path, self.proc = path, self

    def poll(self) -> None:
        return None


_server: _Server | _Attached | None = None


def run(
    args: list[str],
    env: dict | None = None,
    cwd: str | Path | None = None,
    timeout: float = 300,
    new_session: bool = False,
    log: Path | None = None,
) -> subprocess.CompletedProcess:
    """``python -m ddpkit ARGS`` to its end, forked from the server: its exit code and output, as
    ``subprocess.run(..., capture_output=True, text=True)`` gives them (with ``log``: both
    streams into that file, as ``stderr=STDOUT``, and none returned). Past ``timeout`` it is
    killed (with its session, if it has one) and ``subprocess.TimeoutExpired`` raised."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    request = {
        "args": list(map(str, args)),
        "env": dict(os.environ if env is None else env),
        "cwd": str(cwd or os.getcwd()),
        "session": new_session,
    }
    command = ["python", "-m", "ddpkit", *request["args"]]
    with contextlib.ExitStack() as files:
        if log is None:
            out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
        else:
            out = err = files.enter_context(open(log, "w+"))  # both streams, as stderr=STDOUT
        devnull = files.enter_context(open(os.devnull))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(_server.path)
            fds = [devnull.fileno(), out.fileno(), err.fileno()]
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
            (pid,) = struct.unpack("!i", _read(conn, 4))
            conn.settimeout(timeout)
            try:
                (code,) = struct.unpack("!i", _read(conn, 4))
            except TimeoutError:
                _kill(pid, new_session)
                conn.settimeout(30)
                _read(conn, 4)
                raise subprocess.TimeoutExpired(command, timeout) from None
        if log is not None:
            return subprocess.CompletedProcess(command, code, "", "")
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, code, out.read(), err.read())


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the test zygote closed the connection")
        data += chunk
    return data


def _kill(pid: int, session: bool) -> None:
    try:
        os.killpg(pid, signal.SIGKILL) if session else os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(0.1)


if __name__ == "__main__":
    _serve(sys.argv[1])
