"""The launcher's TCPStores: each listens on one address, and the workers get a fresh one per round.

Two faults of the stores torch's elastic agent sets up, both fixed here rather than in scripts:

- **Bound to every interface.** torch's TCPStore server listens on the wildcard address whatever
  host name it is given, even for a single-node run, and it has no authentication: anyone who
  reaches the port can read and overwrite every key (ranks' addresses, rendezvous state), which
  is enough to end or misdirect a job. ddpkit binds the listening socket itself, to loopback for
  a single node and to the one address the other nodes use for several (or where
  ``--rdzv-conf bind_addr=ADDR`` asks), and hands it to the store (``master_listen_fd``).
- **One worker store for every restart** (pytorch issue 167288). The agent shares its store with
  the workers for the whole job, and ``init_process_group`` keys carry no attempt number, so after a
  worker dies the restarted ranks can read the dead ranks' gloo addresses and fail with
  "Connection refused", or hang. ``FreshWorkerStore`` hosts a new store for the workers of every
  rendezvous round on the agent of node rank 0 instead, so no key outlives its round.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ddpkit.errors import ConfigError
from ddpkit.launch.ports import answers

LOOPBACK = "127.0.0.1"
WORKER_STORE_KEY = "ddpkit/worker-store"  # in the round's rendezvous store: HOST:PORT of the workers' store
WORKER_STORE_TIMEOUT_S = 60.0
UNREACHABLE_KEY = "ddpkit/unreachable"  # in the round's rendezvous store: why a node gave up on it
UNREACHABLE_WAIT_S = 10.0  # how long node 0 waits for another node's reason after its own timeout


def ip_of(host: str) -> str:
    """The first IP address of ``host``, as a store should bind it (a name is resolved once here)."""
    if host in ("", "localhost"):
        return LOOPBACK
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise ConfigError(f"address {host!r} does not resolve ({exc.strerror}); use an IP address") from None


def route_source(host: str) -> str:
    """This machine's address on the route to ``host``: the one peers there can reach us at.

    A UDP ``connect`` sends nothing; it only asks the kernel which source address it would use.
    """
    ip = ip_of(host)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((ip, 9))
        return sock.getsockname()[0]


def listening_socket(bind: str, port: int) -> socket.socket:
    """A TCP socket listening on ``bind:port`` only (port 0: the OS picks a free one)."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As TCPStore's own server does: an earlier run's connections in TIME_WAIT must not keep a
    # fixed --master-port from being bound again.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def bound_store(bind: str, port: int, timeout_s: float, *, host: str | None = None) -> dist.TCPStore:
    """A TCPStore server listening on ``bind:port`` alone, and this process's client of it.

    Args:
        bind: the address to listen on (an IP, or ``0.0.0.0`` only when a user asked for it).
        port: the port, or 0 for a free one (read it back from ``.port``).
        timeout_s: the store's timeout for ``get`` and ``wait``.
        host: where this process's own client connects; ``bind`` by default (loopback for ``0.0.0.0``).

    Raises:
        OSError: the port is taken on that address (``errno.EADDRINUSE``).
    """
    sock = listening_socket(bind, port)
    client_host = host or (LOOPBACK if bind in ("0.0.0.0", "::") else bind)
    # The store takes the descriptor over and closes it when it is destroyed.
    return dist.TCPStore(
        client_host,
        sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        multi_tenant=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),
    )


class WrappedHandler(RendezvousHandler):
    """A rendezvous handler that passes everything to ``self.inner``; subclasses change a part."""

    inner: RendezvousHandler

    def get_backend(self) -> str:
        return self.inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        return self.inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()


class FreshWorkerStore(WrappedHandler):
    """Any rendezvous handler, with a new store for the workers of every round it completes.

    Node rank 0's agent opens the store on ``bind`` and posts ``advertise:PORT`` in the round's
    rendezvous store; the other nodes read it there. The previous round's store is closed first:
    the agent stops the old workers before it calls ``next_rendezvous`` again.

    Args:
        inner: the handler that runs the rendezvous (torch's c10d, or ddpkit's static).
        bind: the address node 0 listens on for the workers.
        advertise: the address the workers connect to (``bind``, unless that is a wildcard).
        timeout_s: the store's timeout, and how long other nodes wait for node 0's address.
        on_round: called after each round with this node's rank, the number of nodes, the new
            store (node 0: the store itself, so the callee may keep it up; others: a client), and
            the round's rendezvous store.
    """

    def __init__(
        self,
        inner: RendezvousHandler,
        bind: str,
        advertise: str,
        timeout_s: float,
        on_round: Callable[[int, int, dist.Store, dist.Store], None] | None = None,
    ) -> None:
        self.inner, self.bind, self.advertise, self.timeout_s = inner, bind, advertise, timeout_s
        self.on_round = on_round
        self.worker_store: dist.Store | None = None  # the current round's, as this node sees it

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to the store below as clients; none of them hosts one

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        self.worker_store = None  # drop the old round's store (and its server, on node 0)
        if info.rank == 0:
            self.worker_store = bound_store(self.bind, 0, self.timeout_s, host=self.advertise)
            info.store.set(WORKER_STORE_KEY, f"{self.advertise}:{self.worker_store.port}")
        host, _, port = info.store.get(WORKER_STORE_KEY).decode().rpartition(":")
        if self.worker_store is None:
            self._check_reachable(host, int(port), info.rank, info.store)
            self.worker_store = dist.TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=self.timeout_s)
            )
        if self.on_round is not None:
            self.on_round(info.rank, info.world_size, self.worker_store, info.store)
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(host, int(port)))

    def _check_reachable(self, host: str, port: int, node_rank: int, round_store: dist.Store) -> None:
        """Plain TCP connects first: a TCPStore client would print C++ traces until its timeout.

        The reason also goes to the round's store, where node 0's launcher, which waits for this
        node in torch's agent until the same timeout, reads it (``peer_unreachable``).
        """
        deadline = time.monotonic() + self.timeout_s
        while (why := answers(host, port, min(2.0, deadline - time.monotonic()))) is not None:
            if time.monotonic() >= deadline:
                me, waited = f"{socket.gethostname()} at {self.advertise}", f"{why}, for {self.timeout_s:g} s"
                line = (
                    f"node {node_rank} ({me}) cannot reach the workers' store at {host}:{port}, the address "
                    f"node 0 advertised ({waited}); start node 0 with --local-addr set to an address the "
                    "other nodes reach, or open the port in the firewall"
                )
                round_store.set(UNREACHABLE_KEY, line)
                raise ConfigError(line)
            time.sleep(0.2)

    # shutdown() leaves the worker store open: the launcher reads what the last round left in
    # it (a hang report's reporter) after the agent has given up.


def peer_unreachable(round_store: dist.Store | None, wait_s: float = UNREACHABLE_WAIT_S) -> str | None:
    """Why another node of the round could not reach this node's workers' store, if one said so.

    torch's agent waits for every node's role in the round for the store's timeout; a node
    that cannot reach the store gives up after the same time (``FreshWorkerStore``), so its reason
    may come a moment after this node's own timeout: wait ``wait_s`` for it.

    Args:
        round_store: the round's rendezvous store (None: no round started).
        wait_s: how long to wait for the reason.
    """
    deadline = time.monotonic() + wait_s
    while round_store is not None:
        try:
            if round_store.check([UNREACHABLE_KEY]):
                return round_store.get(UNREACHABLE_KEY).decode()
        except RuntimeError:  # the rendezvous store's host is gone
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)
    return None


def rendezvous_bind(params: RendezvousParameters, host: str) -> str:
    """Where the rendezvous store listens: ``bind_addr`` if asked, loopback for one node, else ``host``."""
    asked = params.config.get("bind_addr")
    if asked:
        return ip_of(asked)
    return LOOPBACK if params.max_nodes == 1 else ip_of(host)


def fresh_worker_store(
    inner: RendezvousHandler, params: RendezvousParameters, node0_addr: str | None
) -> FreshWorkerStore:
    """``inner`` with a fresh worker store per round, listening where the workers reach it.

    One node: loopback. Several: ``--local-addr`` if given, else ``node0_addr`` (static: the
    --master-addr every node already uses), else this machine's address on the route to the
    c10d endpoint, which is one the other nodes can reach.
    """
    asked = params.config.get("bind_addr")
    hooks = params.config.get("ddpkit_hooks")
    on_round = getattr(hooks, "on_round", None)
    if params.max_nodes == 1:
        advertise = LOOPBACK
    elif params.local_addr:
        advertise = ip_of(params.local_addr)
    elif node0_addr:
        advertise = ip_of(node0_addr)
    else:
        advertise = route_source(parse_rendezvous_endpoint(params.endpoint, default_port=0)[0])
    bind = ip_of(asked) if asked else advertise
    # The nodes other than 0 wait for its store as long as for the rendezvous's own store.
    config = params.config
    timeout = float(config.get("read_timeout") or config.get("timeout") or WORKER_STORE_TIMEOUT_S)
    return FreshWorkerStore(inner, bind, advertise, timeout, on_round)
