"""Ports for rendezvous: find a free one, or tell the user that theirs is taken."""

from __future__ import annotations

import errno
import socket

from ddpkit.errors import ConfigError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; a tiny reuse race remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(port: int, flag: str = "--master-port") -> None:
    """Fail with a one-line error when ``port`` cannot be bound on this machine.

    Args:
        port: the port the rendezvous server will listen on.
        flag: the command-line flag that set it, named in the error.
    """
    if not 0 < port < 65536:
        raise ConfigError(f"{flag} {port} is not a TCP port; use a number between 1024 and 65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise ConfigError(
                f"{flag} {port} is already in use on this machine; pick a free port "
                "or leave the flag out and ddpkit picks one"
            ) from None
