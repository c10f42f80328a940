"""The watchdog's own line to the rendezvous store: a separate client, and calls that cannot block it."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)

STORE_PREFIX = "ddpkit/hang"
STORE_TIMEOUT_S = 5.0


def watchdog_store(timeout_s: float = STORE_TIMEOUT_S) -> dist.Store:
    """A client of the default group's store for the watchdog alone.

    The main thread may be inside a store call (new_group, a store barrier) when the watchdog
    needs the store, and one TCPStore client serializes its calls with a lock; ``clone()`` opens a
    second connection to the same server (c10d's "thread safe copy" of a store), whose timeout can
    then be short without touching the process group's.

    Args:
        timeout_s: the timeout of ``get`` and ``wait`` on the clone.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("HangWatchdog needs a process group: call ddpkit.init_distributed() first")
    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


class BoundedStore:
    """Store calls that give up after ``timeout_s`` instead of blocking the caller forever.

    In torch 2.13 a TCPStore ``check`` on a store host frozen by SIGSTOP (rank 0 under
    ``ddpkit.launch``) waits for the reply forever: the store's timeout bounds ``get`` and
    ``wait``, not every call. So calls run on one daemon worker thread and the caller waits at
    most ``timeout_s``; while an earlier call is still stuck on that worker, every call fails at
    once. Failures return None.

    Args:
        store: the store to call, prefixed with ``STORE_PREFIX``.
        timeout_s: how long one call may take.
    """

    def __init__(self, store: dist.Store, timeout_s: float = STORE_TIMEOUT_S) -> None:
        self.store, self.timeout_s = dist.PrefixStore(STORE_PREFIX, store), timeout_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Future | None = None
        self._worker = threading.Thread(target=self._serve, name="ddpkit-hang-store", daemon=True)
        self._worker.start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            method, args, future = item
            try:
                future.set_result(getattr(self.store, method)(*args))
            except Exception as exc:
                future.set_exception(exc)

    def call(self, method: str, *args: Any) -> Any:
        """``store.<method>(*args)``, or None when it fails or takes longer than ``timeout_s``."""
        if self._last is not None and not self._last.done():
            return None  # the worker is still stuck in an earlier call: the store host is frozen
        self._last = future = Future()
        self._calls.put((method, args, future))
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            log.debug(
                "hang watchdog: store.%s took over %g s; the store host may be frozen", method, self.timeout_s
            )
        except RuntimeError as exc:  # DistStoreError, DistNetworkError: the host may be gone
            log.debug("hang watchdog: store.%s failed: %s", method, exc)
        return None

    def close(self) -> None:
        """Let the worker end once it is free (a worker stuck in a call stays, as a daemon)."""
        self._calls.put(None)
