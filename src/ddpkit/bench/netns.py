"""Emulated hosts on one machine: network namespaces on a switch, each link capped with tc's tbf.

Each host is a network namespace with one veth interface whose other end sits on a bridge in a
switch namespace. The host end's egress is shaped by a token bucket (``tc qdisc ... tbf``), so
every host sends at most ``rate`` bits per second, as a NIC on a switch would: a ring
all-reduce, where each host sends to one neighbour and receives from another, is then limited
by the rate of each link. The hosts share the CPU, memory and filesystem; only their network
is separate. Needs root (``ip netns``) and iproute2; ``why_not`` says when it cannot run.

Every namespace made here is deleted on the way out, with every process still inside it (only
processes started by this code live there), also on an exception or Ctrl-C.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ddpkit.errors import ConfigError

SUBNET = "10.124.0"
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True)
class Host:
    """One emulated host.

    Args:
        ns: its network namespace; run a command there with ``ip netns exec NS``.
        iface: its one network interface (what ``GLOO_SOCKET_IFNAME`` should name).
        addr: its IPv4 address on the emulated network.
    """

    ns: str
    iface: str
    addr: str


def parse_rate(text: str) -> float:
    """Bits per second from tc-style text: ``300mbit``, ``1gbit``, ``25gbit``, ``1e9``.

    Args:
        text: a number with an optional k/m/g prefix and an optional ``bit`` suffix.
    """
    found = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmg]?)(?:bit)?\s*", text.lower())
    if not found or float(found[1]) <= 0:
        raise ConfigError(f"link rate {text!r} is not a rate; write it as tc does, e.g. 300mbit or 1gbit")
    return float(found[1]) * _UNITS[found[2]]


def why_not() -> str | None:
    """Why emulated hosts cannot be made here, or None when they can."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2's ip and tc commands"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run it as root, or with CAP_NET_ADMIN)"
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}; are ip netns and tc usable here?")


def _shape(ns: str, iface: str, rate_bps: float) -> None:
    # burst: 2 ms at the rate, at least a few full-size frames; a smaller bucket cannot keep a fast
    # link busy between timer ticks. latency bounds the queue (TCP fills it; drops would cost more).
    burst = max(64 * 1024, int(rate_bps / 8 * 0.002))
    tbf = f"rate {int(rate_bps)}bit burst {burst} latency 50ms"
    _run("ip", "netns", "exec", ns, *f"tc qdisc add dev {iface} root tbf {tbf}".split())


@contextmanager
def emulated_hosts(count: int, rate_bps: float | None, tag: str | None = None) -> Iterator[list[Host]]:
    """``count`` hosts on a switch, each link capped at ``rate_bps`` (None: uncapped); removed after.

    Args:
        count: hosts, at least 2.
        rate_bps: each host's sending rate in bits per second.
        tag: distinguishes the names of concurrent runs; the process id when None.
    """
    assert 2 <= count <= 200, f"emulated_hosts: {count} hosts, want 2..200"
    tag = tag or str(os.getpid())
    switch = f"dks{tag}"
    hosts = [Host(f"dkh{tag}x{i}", f"dkv{tag}x{i}", f"{SUBNET}.{i + 1}") for i in range(count)]
    made: list[str] = []
    previous = signal.getsignal(signal.SIGTERM)
    # A SIGTERM (a killed benchmark) unwinds through the finally below, like Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for ns in [switch] + [h.ns for h in hosts]:
            _run("ip", "netns", "add", ns)
            made.append(ns)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            port = f"dkp{i}"
            veth = f"link add {host.iface} netns {host.ns} type veth peer name {port} netns {switch}"
            _run("ip", *veth.split())
            _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.iface)
            _run("ip", "-n", host.ns, "link", "set", "lo", "up")
            _run("ip", "-n", host.ns, "link", "set", host.iface, "up")
            if rate_bps is not None:
                _shape(host.ns, host.iface, rate_bps)
        yield hosts
    finally:
        signal.signal(signal.SIGTERM, previous)
        for ns in reversed(made):
            _remove(ns)


def _remove(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)  # only processes this module started live in there
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # takes its veths along


def exec_prefix(host: Host) -> list[str]:
    """The command prefix that runs a program on ``host``."""
    return ["ip", "netns", "exec", host.ns]
