"""`python -m ddpkit ARGS` for the tests, started in milliseconds: forked from a server that has
torch and ddpkit's launcher imported once (about 1.7 CPU-seconds of imports a launch otherwise).

The server (tests/zygote_server.py) runs one per test process, started at the first launch and
ended with the test process. Each launch (``run`` to its end, or ``Popen``) sends the command's
arguments, environment and folder, and its output files' descriptors, over a Unix socket; the
server forks, and the child becomes the launcher: its own process, with its own pid, whose
workers are its children. Its workers are forked from it in turn, before it starts a thread
(tests/zygote_workers.py), and handed to torch's elastic agent; a restart's workers are fresh
interpreters. Tests of what a launcher's process is (its parent, how it starts) start it
themselves with subprocess.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

NAME = "ddpkit-test-zygote"  # in the server's command line: conftest's leftover check skips it
ROOM = "DDPKIT_TEST_ZYGOTE_ROOM"
SERVER = Path(__file__).with_name("zygote_server.py")


class _Server:
    """This test process's server, started at the first launch."""

    def __init__(self) -> None:
        self.path = tempfile.mktemp(prefix="ddpkit-zygote-", suffix=".sock", dir="/tmp")
        # Room for a worker's command line and environment, written over the server's
        # (tests/zygote_workers.py): a long last argument, a long variable the server drops.
        command = [sys.executable, str(SERVER), self.path, NAME, "-" * 8192]
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


def attach(path: str) -> None:
    """In a process the server forked: send this process's launches to that server."""
    global _server
    _server = _Attached(path)


class Popen:
    """``subprocess.Popen([python, -m, ddpkit, *args], ...)``, its launcher forked from the
    server: ``pid``, ``poll``, ``wait``, ``communicate``, ``send_signal``/``terminate``/``kill``,
    ``returncode``, and ``stdout``/``stderr`` pipes with ``subprocess.PIPE`` (``stderr=STDOUT``
    too). Its parent is the server, so its exit code comes over the server's connection."""

    def __init__(
        self, args, stdout=None, stderr=None, text=False, env=None, cwd=None, start_new_session=False
    ) -> None:
        global _server
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        self.args = [sys.executable, "-m", "ddpkit", *map(str, args)]
        self.returncode, self.stdin, self._reads = None, None, None
        request = {
            "args": self.args[3:],
            "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or os.getcwd()),
            "session": start_new_session,
        }
        with contextlib.ExitStack() as sent:  # our copies of the descriptors the launcher gets
            devnull = sent.enter_context(open(os.devnull))
            out, self.stdout = self._target(stdout, 1, text, sent)
            if stderr == subprocess.STDOUT:
                err, self.stderr = out, None
            else:
                err, self.stderr = self._target(stderr, 2, text, sent)
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._conn.connect(_server.path)
            socket.send_fds(self._conn, [json.dumps(request).encode()], [devnull.fileno(), out, err])
            (self.pid,) = struct.unpack("!i", _read(self._conn, 4))

    @staticmethod
    def _target(where, default: int, text: bool, sent: contextlib.ExitStack):
        """(the descriptor the launcher writes to, our end of a pipe or None)."""
        if where is None:
            return default, None
        if where == subprocess.DEVNULL:
            return sent.enter_context(open(os.devnull, "w")).fileno(), None
        if where != subprocess.PIPE:
            return where if isinstance(where, int) else where.fileno(), None
        read, write = os.pipe()
        sent.callback(os.close, write)
        return write, open(read, "r" if text else "rb")

    def poll(self) -> int | None:
        if self.returncode is None:
            self._await(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._await(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _await(self, timeout: float | None) -> bool:
        """The exit code, once the server sends it within ``timeout`` seconds; False before."""
        self._conn.settimeout(timeout)
        try:
            data = _read(self._conn, 4)
        except (TimeoutError, BlockingIOError):
            self._conn.settimeout(None)
            return False
        (self.returncode,) = struct.unpack("!i", data)
        self._conn.close()
        return True

    def communicate(self, timeout: float | None = None) -> tuple:
        """Both pipes read to their end, then the exit: (stdout, stderr), None for one not piped
        (or read by an earlier call). Past ``timeout``: TimeoutExpired, and a later call goes on."""
        if self._reads is None:
            pool = ThreadPoolExecutor(2)
            pipes = [f if f is not None and not f.closed else None for f in (self.stdout, self.stderr)]
            self._reads = [None if f is None else pool.submit(f.read) for f in pipes]
            pool.shutdown(wait=False)
        deadline = None if timeout is None else time.monotonic() + timeout
        left = lambda: None if deadline is None else max(deadline - time.monotonic(), 0.01)  # noqa: E731
        try:
            found = tuple(None if read is None else read.result(left()) for read in self._reads)
        except FuturesTimeout:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        self.wait(left())
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self._reads = [None, None]
        return found

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


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
    with contextlib.ExitStack() as files:
        if log is None:
            out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
        else:
            out = err = files.enter_context(open(log, "w+"))  # both streams, as stderr=STDOUT
        proc = Popen(args, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=new_session)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill(proc.pid, new_session)
            proc.wait(30)
            raise
        if log is not None:
            return subprocess.CompletedProcess(proc.args, code, "", "")
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, code, out.read(), err.read())


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
