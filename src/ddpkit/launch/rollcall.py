"""The roll call: checks that the nodes of a job make through the rendezvous store.

All keys live under ``ddpkit/rollcall/RUN_ID/`` in the store every node already shares:

- ``nnodes``: ``compare_set`` from empty to this node's ``--nnodes``; the first node's value stays,
  and a node that finds another value posts ``error``.
- ``node{R}``: the same for ``--node-rank R`` (static rendezvous only); a second node with the
  same rank posts ``error``.
- then each node waits until ``node0 .. node{N-1}`` are all there, or an ``error`` is posted
  (raised on every waiting node, so all print the same line), or the timeout passes (naming the
  node ranks that never came).
- ``joined`` and ``seen`` count the nodes that started the roll call and those that ended it with
  an error: node 0, whose process holds the store, waits for them to match before it exits.

Nodes are named ``HOST pid PID``, so a node started again by hand under the same static
rendezvous counts as a duplicate (torch's static rendezvous cannot take a node back either).
"""

from __future__ import annotations

import os
import socket
import time

import torch.distributed as dist

from ddpkit.errors import ConfigError


def this_node() -> str:
    """How errors name this node."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def nnodes_text(low: int, high: int) -> str:
    """``--nnodes`` as a user writes it: ``2``, or ``1:4`` for an elastic range."""
    return str(low) if low == high else f"{low}:{high}"


def post_error(store: dist.Store, message: str) -> ConfigError:
    """Publish ``message`` to every node still in the roll call, and return it as an error."""
    store.set("error", message)
    return ConfigError(message)


def check_same_nnodes(store: dist.Store, nnodes: str) -> None:
    """The first node's ``--nnodes`` stays in the store; another value is an error."""
    me = this_node()
    first, them = store.compare_set("nnodes", "", f"{nnodes}|{me}").decode().split("|", 1)
    if first != nnodes:
        raise post_error(
            store,
            f"nodes disagree on --nnodes: {them} has --nnodes {first}, {me} has --nnodes {nnodes}; "
            "start every node with the same --nnodes",
        )


def roll_call(store: dist.Store, node_rank: int, nnodes: int, timeout: float, where: str) -> None:
    """Static rendezvous: same ``--nnodes`` everywhere, each ``--node-rank`` once, all nodes present."""
    store.add("joined", 1)
    try:
        check_same_nnodes(store, str(nnodes))
        claim_node_rank(store, node_rank, nnodes)
        wait_for_nodes(store, nnodes, timeout, where)
    except ConfigError:
        store.add("seen", 1)  # node 0 keeps the store up until every node that joined got here
        raise


def claim_node_rank(store: dist.Store, node_rank: int, nnodes: int) -> None:
    """The first node with ``--node-rank R`` holds ``node{R}``; a second one is an error."""
    me = this_node()
    holder = store.compare_set(f"node{node_rank}", "", me).decode()
    if holder != me:
        raise post_error(
            store,
            f"two nodes have --node-rank {node_rank}: {holder} and {me}; give each node its own "
            f"--node-rank, 0 to {nnodes - 1}",
        )


def wait_for_nodes(store: dist.Store, nnodes: int, timeout: float, where: str) -> None:
    """Until node0 .. node{N-1} are all in; an error another node posted is raised here too."""
    keys = [f"node{rank}" for rank in range(nnodes)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if store.check(["error"]):
            raise ConfigError(store.get("error").decode())
        if time.monotonic() >= deadline:
            missing = [rank for rank in range(nnodes) if not store.check([f"node{rank}"])]
            raise ConfigError(
                f"--node-rank {', '.join(map(str, missing))} did not join the rendezvous at {where} "
                f"within {timeout:g} s; start every node with the same --master-addr, --master-port "
                f"and --nnodes {nnodes}, or wait longer with --rdzv-conf timeout=SECONDS"
            )
        time.sleep(0.05)


def linger(store: dist.Store, grace: float = 5.0) -> None:
    """Keep node 0's store up until every node that joined has read the error (``grace`` s at most).

    The store dies with node 0's process; a node cut off in the middle of a store call would print
    C++ stack traces instead of the error line.
    """
    deadline = time.monotonic() + grace
    while store.add("seen", 0) < store.add("joined", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
