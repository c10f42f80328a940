"""The test zygote's server (tests/zygote.py starts it, one per test process): torch and ddpkit
imported once; for each request it forks the launcher the request names (``_become``), which
forks its workers-to-be first (tests/zygote_workers.py) and, in ``ddpkit check``, sends each
trial back here to be forked the same way (``_route_trials``). It exits once the test process
is gone."""

from __future__ import annotations

import atexit
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
from pathlib import Path

import zygote
import zygote_workers


def _serve(path: str) -> None:
    os.environ.pop(zygote.ROOM)
    pythonpath = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    site_path = [p for p in sys.path[1:] if os.path.abspath(p) not in pythonpath]
    # The imports every launch and its workers share, done once (torch._dynamo: the first
    # optimizer a worker builds imports it).
    import torch._dynamo  # noqa: F401

    import ddpkit  # noqa: F401
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

    zygote.attach(path)

    class Subprocess:  # the module ``trials`` calls subprocess.run through
        def __getattr__(self, name: str):
            return getattr(subprocess, name)

        @staticmethod
        def run(command, stdout=None, stderr=None, env=None, **kwargs):
            if command[:3] == [sys.executable, "-m", "ddpkit"] and stderr == subprocess.STDOUT and not kwargs:
                return zygote.run(command[3:], env=env, log=Path(stdout.name))
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
        tempfile.tempdir = None  # read TMPDIR afresh: an import in the server cached its own
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


if __name__ == "__main__":
    _serve(sys.argv[1])
