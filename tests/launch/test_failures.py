"""A network failure is named with the peer's address, from gloo's own error text."""

from __future__ import annotations

from ddpkit.launch.failures import network_cause

REFUSED = (
    "RuntimeError: Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
    "tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:53133$1"
)
UNREACHABLE = "RuntimeError: [../tcp/pair.cc:144] connect: No route to host, remote=[10.0.0.2]:4242"
RESET = "RuntimeError: [../tcp/pair.cc:589] Read error [10.0.0.3]:25266: Connection reset by peer"
CLOSED = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.4]:10895"


def test_an_unreachable_peer_is_named_with_its_address():
    refused, unreachable = network_cause(REFUSED), network_cause(UNREACHABLE)
    assert refused.startswith("network: the peer at 127.0.0.1:53133 was unreachable (Connection refused)")
    assert unreachable.startswith("network: the peer at 10.0.0.2:4242 was unreachable (No route to host)")
    # The address comes before the words in a read error, after them otherwise.
    reset, closed = network_cause(RESET), network_cause(CLOSED)
    assert reset.startswith("network: the peer at 10.0.0.3:25266 was unreachable (Connection reset"), reset
    assert closed.startswith("network: the peer at 10.0.0.4:10895 was unreachable (Connection closed"), closed
    assert network_cause("RuntimeError: shapes do not match") is None
