"""Multi-node rendezvous that fails in seconds with one line on bad input, instead of hanging.

torch's static and c10d rendezvous trust every node's flags. An address nobody answers at waits
out the whole timeout (15 minutes for static) and then prints C++ stack traces; two nodes with the
same ``--node-rank``, or with different ``--nnodes``, meet in the store and then wait for each
other until the timeout. ``ddpkit`` launches multi-node jobs through two thin variants instead,
registered with torch's rendezvous registry under the names in ``CHECKED``:

``ddpkit-static``: torch's static rendezvous (one TCPStore, hosted by node 0's agent), where
    a node other than 0 first probes ``--master-addr:--master-port`` with plain TCP connects
    until the rendezvous ``timeout`` (``--rdzv-conf timeout=S``, torchrun's 900 s by default),
    node 0 checks that no other node 0 already answers there, and then all nodes take the roll
    call of ``ddpkit.launch.rollcall`` (same ``--nnodes``, each ``--node-rank`` once, all present).
``ddpkit-c10d``: torch's c10d rendezvous, with the store opened here so that the host is
    recognised by any address of this machine (torch's hostname heuristic misses secondary
    NICs), a non-host node probes ``--rdzv-endpoint`` for ``read_timeout`` seconds (torch's own
    connect timeout, 60 by default), and the roll call's ``--nnodes`` check runs before the node
    joins. A node with other ``--nnodes`` fails; the nodes already there keep waiting for valid
    peers, as an elastic job should, and name the node turned away if their join_timeout passes.
    Node ranks are assigned by c10d itself.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ddpkit.errors import ConfigError
from ddpkit.launch.ports import answers, is_local_address, wait_reachable
from ddpkit.launch.rollcall import check_same_nnodes, linger, nnodes_text, roll_call
from ddpkit.launch.stores import (
    WrappedHandler,
    bound_store,
    fresh_worker_store,
    rendezvous_bind,
    route_source,
)

# torch's rendezvous name -> ddpkit's checked variant of it.
CHECKED = {"static": "ddpkit-static", "c10d": "ddpkit-c10d"}
STATIC_TIMEOUT = 900  # torchrun's default rendezvous timeout, seconds
C10D_READ_TIMEOUT = 60  # torch's default c10d store timeout, seconds
C10D_PORT = 29400  # torch's default c10d port


def checked_backend(backend: str) -> str:
    """The registered ddpkit variant of ``backend`` (other backends, e.g. etcd, are returned as is)."""
    rendezvous_handler_registry.register(CHECKED["static"], _create_static)
    rendezvous_handler_registry.register(CHECKED["c10d"], _create_c10d)
    return CHECKED.get(backend, backend)


def node_zero_port_taken(port: int) -> ConfigError:
    """The error for a static node 0 whose --master-port is taken on its machine."""
    return ConfigError(
        f"--master-port {port} is already in use on this machine: another node started here with "
        "--node-rank 0, or another program holds the port; give each node its own --node-rank, "
        "or pick a free --master-port"
    )


def connect(host: str, port: int, timeout: float, flag: str) -> dist.TCPStore:
    """A TCPStore client of the rendezvous at HOST:PORT, once something answers there."""
    wait_reachable(host, port, timeout, flag)
    try:
        return dist.TCPStore(
            host, port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=timeout)
        )
    except dist.DistError as exc:
        why = str(exc).splitlines()[0]
        raise ConfigError(
            f"{flag} {host}:{port} answers, but not as a rendezvous store ({why}); check the address and "
            "port of the node that hosts the rendezvous"
        ) from None


class StaticRollCallRendezvous(RendezvousHandler):
    """torch's static rendezvous (a TCPStore on node 0, fixed ranks), checked as the module says.

    Args:
        params: torchrun's rendezvous parameters: endpoint ``MASTER_ADDR:MASTER_PORT``, ``max_nodes``
            nodes, and ``rank`` (``--node-rank``) and ``timeout`` (seconds) in its config.
    """

    def __init__(self, params: RendezvousParameters) -> None:
        self.addr, self.port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
        self.node_rank = int(params.config["rank"])
        self.nnodes = params.max_nodes
        self.run_id = params.run_id
        self.timeout = float(params.config.get("timeout", STATIC_TIMEOUT))
        self.bind_asked = bool(params.config.get("bind_addr"))
        self.bind = rendezvous_bind(params, self.addr)
        self._store: dist.TCPStore | None = None
        self._rounds = 0

    def get_backend(self) -> str:
        return CHECKED["static"]

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        # Called again on every restart of the workers: the store and the roll call stay.
        if self._store is None:
            self._store = self._open_store()
            where = f"{self.addr}:{self.port}"
            roll = dist.PrefixStore(f"ddpkit/rollcall/{self.run_id}", self._store)
            try:
                roll_call(roll, self.node_rank, self.nnodes, self.timeout, where)
            except ConfigError:
                if self.node_rank == 0:
                    linger(roll)
                raise
        # A prefix per round, as c10d has: the agents of a restart must not read the keys of the
        # last one (all nodes restart together, so they count the same rounds).
        self._rounds += 1
        store = dist.PrefixStore(f"{self.run_id}/round{self._rounds}", self._store)
        return RendezvousInfo(store, self.node_rank, self.nnodes, RendezvousStoreInfo(self.addr, self.port))

    def _open_store(self) -> dist.TCPStore:
        if self.node_rank != 0:
            return connect(self.addr, self.port, self.timeout, "--master-addr/--master-port")
        # Node 0 listens on --master-addr alone (loopback for one node); a node 0 on a machine
        # that does not hold that address is a duplicate when the real one already answers there.
        if not is_local_address(self.addr, "--master-addr"):
            if self.nnodes > 1 and answers(self.addr, self.port, 1) is None:
                raise ConfigError(
                    f"another node already hosts the rendezvous at {self.addr}:{self.port} as --node-rank 0; "
                    f"give each node its own --node-rank, 0 to {self.nnodes - 1}"
                )
            if self.nnodes > 1 and not self.bind_asked:
                raise ConfigError(
                    f"--master-addr {self.addr} is not an address of this machine, and node 0 hosts the "
                    "rendezvous there; start --node-rank 0 on the machine at that address"
                )
        try:
            # The roll call, not the store, waits for the other nodes (the store never blocks on
            # them), so that a node with a wrong --nnodes or --node-rank is reported, not awaited.
            return bound_store(self.bind, self.port, self.timeout)
        except OSError:
            raise node_zero_port_taken(self.port) from None

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def _create_static(params: RendezvousParameters) -> RendezvousHandler:
    inner = StaticRollCallRendezvous(params)
    return fresh_worker_store(inner, params, node0_addr=inner.addr)


class CheckedC10dRendezvous(WrappedHandler):
    """torch's c10d handler under ddpkit's name, whose join timeout is a one-line error.

    Args:
        inner: torch's DynamicRendezvousHandler.
        roll: the roll-call keys of this run, where a node turned away left its reason.
        where: the endpoint HOST:PORT, for messages.
        params: the rendezvous parameters (``join_timeout`` and the node counts, for messages).
    """

    def __init__(
        self, inner: RendezvousHandler, roll: dist.Store, where: str, params: RendezvousParameters
    ) -> None:
        self.inner, self.roll, self.where = inner, roll, where
        self.join_timeout = params.get_as_int("join_timeout", 600)
        self.nnodes = nnodes_text(params.min_nodes, params.max_nodes)

    def get_backend(self) -> str:
        return CHECKED["c10d"]  # torch's registry checks that a handler reports the name it was made for

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self.inner.next_rendezvous()
        except RendezvousTimeoutError:
            turned_away = self.roll.get("error").decode() if self.roll.check(["error"]) else ""
            raise ConfigError(
                f"the rendezvous at {self.where} did not complete within join_timeout {self.join_timeout} s: "
                f"too few nodes with --nnodes {self.nnodes} joined"
                + (f" (one was turned away: {turned_away})" if turned_away else "")
                + "; start the other nodes with the same --rdzv-endpoint, --rdzv-id and --nnodes, "
                "or wait longer with --rdzv-conf join_timeout=SECONDS"
            ) from None


def _open_c10d_store(params: RendezvousParameters, host: str, port: int) -> dist.TCPStore:
    """The c10d rendezvous store: hosted here when the endpoint is this machine, else joined."""
    timeout = params.get_as_int("read_timeout", C10D_READ_TIMEOUT)
    is_host = params.get_as_bool("is_host")
    if is_host is None:
        is_host = is_local_address(host, "--rdzv-endpoint")
    if is_host:
        try:
            return bound_store(rendezvous_bind(params, host), port, timeout)
        except OSError:
            pass  # another agent on this machine hosts it already (several nodes on one machine): join it
    return connect(host, port, timeout, "--rdzv-endpoint")


def _create_c10d(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=C10D_PORT)
    if params.get("store_type", "tcp").strip().lower() != "tcp":
        backend, store = create_backend(params)  # a FileStore: no address to check
    else:
        store = _open_c10d_store(params, host, port)
        backend = C10dRendezvousBackend(store, params.run_id)
    roll = dist.PrefixStore(f"ddpkit/rollcall/{params.run_id}", store)
    check_same_nnodes(roll, nnodes_text(params.min_nodes, params.max_nodes))
    if not params.local_addr and params.max_nodes > 1:
        # torch names this node by its host name, which containers share; its address on the
        # route to the endpoint is one the other nodes can tell apart, and reach.
        params.local_addr = route_source(host)
    inner = create_handler(store, backend, params)
    checked = CheckedC10dRendezvous(inner, roll, f"{host}:{port}", params)
    return fresh_worker_store(checked, params, node0_addr=None)
