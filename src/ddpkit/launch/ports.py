"""Addresses and ports for rendezvous: free ports, taken ports, and bounded probes of other nodes.

A probe is plain TCP connects until a deadline, so a wrong address ends in an error, not a hang.
"""

from __future__ import annotations

import errno
import socket
import time

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
        # As TCPStore's server does: connections of an earlier run lingering in TIME_WAIT do not
        # keep the port from being bound again; only a live listener does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise ConfigError(
                f"{flag} {port} is already in use on this machine; pick a free port "
                "or leave the flag out and ddpkit picks one"
            ) from None


def resolve(host: str, flag: str) -> list[str]:
    """IP addresses of ``host``; a name that does not resolve is a one-line error at once."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except socket.gaierror as exc:
        raise ConfigError(
            f"{flag} {host!r} does not resolve ({exc.strerror}); use the IP address of the node "
            "that hosts the rendezvous, or a hostname every node can resolve"
        ) from None


def is_local_address(host: str, flag: str) -> bool:
    """True when ``host`` names this machine: some interface holds one of its addresses."""
    if host in ("localhost", socket.gethostname()):
        return True
    for ip in resolve(host, flag):
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((ip, 0))  # only an address of this machine can be bound
                return True
            except OSError:
                continue
    return False


def answers(host: str, port: int, wait: float) -> str | None:
    """None when a TCP connect to HOST:PORT succeeds within ``wait`` seconds, else why not."""
    try:
        with socket.create_connection((host, port), timeout=max(wait, 0.05)):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def wait_reachable(host: str, port: int, timeout: float, flag: str) -> None:
    """Connect to HOST:PORT until it answers; a one-line error once ``timeout`` seconds pass.

    Plain TCP connects, not a TCPStore client: the store's own connect loop overruns its timeout
    and prints C++ stack traces on every retry.
    """
    resolve(host, flag)
    deadline = time.monotonic() + timeout
    while (why := answers(host, port, min(2.0, deadline - time.monotonic()))) is not None:
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"nothing answered at {flag} {host}:{port} within {timeout:g} s ({why}); start the "
                "node that hosts the rendezvous there, check the address, port and firewall, or wait "
                "longer with --rdzv-conf timeout=SECONDS (static) or read_timeout=SECONDS (c10d)"
            )
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
