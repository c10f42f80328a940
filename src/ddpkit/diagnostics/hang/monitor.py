"""The launcher's hang monitor: ``ddpkit run --collective-timeout S`` for scripts that know nothing of it.

A daemon thread beside torch's elastic agent, in the launcher process, which user code cannot
block. Every ``poll_s`` it reads its node's workers (``workers.WorkerProgress``) and speaks for
them in the round's worker store (``exchange.py``, a node as the party): its
answer is faulthandler's dump of each rank's threads, and it kills its workers once it reads the
summary. Node 0 hosts the store, so it decides (``record.find_hang``), writes
``RUN_DIR/hang-report.txt`` and ends the round; the agent then restarts the workers or fails, and
the launcher names the hang from the summary, never from an exit code a script could also use.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist

from ddpkit.diagnostics.hang.exchange import RUN_PREFIX, Exchange, own_client
from ddpkit.diagnostics.hang.record import auto_timeout, find_hang
from ddpkit.diagnostics.hang.report import format_run_report, write_report
from ddpkit.diagnostics.hang.timings import TIMINGS
from ddpkit.diagnostics.hang.workers import WorkerProgress, dump_stacks, is_our_worker

AUTO_SOURCE = "90% of the script's process-group timeout; --collective-timeout S sets another"


class HangMonitor:
    """Watches the workers of every round; ``start()`` it unless ``timeout_s`` is 0.

    Args:
        run_dir: the run directory the workers write their progress and stacks to.
        timeout_s: ``--collective-timeout``: seconds a collective may take; None: ``auto_share`` of
            the script's own process-group timeout; 0: no monitoring.
        poll_s: how often to look.
        announce: print the verdict when it is reached (restarts follow; else the failure says it).
        new_round: told each round's generation (``restarts.RestartLine.on_round``).
        forget: patterns of the launcher's own files in ``run_dir`` that a new round removes with
            the workers' progress and stacks (a ConfigError's message is no news to a restarted
            worker).
    """

    def __init__(
        self,
        run_dir: Path,
        timeout_s: float | None,
        poll_s: float = TIMINGS.poll_s,
        announce: bool = False,
        new_round: Callable[[int], None] | None = None,
        forget: Sequence[str] = (),
    ) -> None:
        self.run_dir, self.timeout_s, self.poll_s, self.announce = run_dir, timeout_s, poll_s, announce
        self.new_round, self.forget = new_round, forget
        self.verdict: str | None = None
        self.report_path = run_dir / "hang-report.txt"
        self._round: tuple[int, int, Exchange, int] | None = None  # node rank, nodes, exchange, generation
        self.worker_store: dist.Store | None = None  # where a watchdog's verdict is read
        self.round_store: dist.Store | None = None  # for stores.peer_unreachable
        self._host_store: dist.Store | None = None
        self._quiet_until = 0.0
        self._seen_generation, self._ended = 0, False
        self._local = WorkerProgress(run_dir)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_round(
        self, node_rank: int, nnodes: int, store: dist.Store, round_store: dist.Store | None = None
    ) -> None:
        """A new round is about to start its workers (the agent stopped the last round's).

        Args:
            node_rank: this node's rank in the round (0 hosts ``store``).
            nnodes: the nodes in the round.
            store: the round's worker store; kept, so that on node 0 it outlives the agent until
                the other nodes have read a verdict.
            round_store: the round's rendezvous store, where a node that cannot reach ``store``
                says so (``stores.peer_unreachable``).
        """
        self.round_store = round_store
        for pattern in ("progress-*", "stacks-*", "exit-*", *self.forget):  # the last round's files
            for path in self.run_dir.glob(pattern):
                path.unlink(missing_ok=True)
        clone = own_client(store)
        generation = self._round[3] + 1 if self._round else 1
        exchange = Exchange(dist.PrefixStore(RUN_PREFIX, clone), node_rank)
        self._round = (node_rank, nnodes, exchange, generation)
        self.worker_store, self._host_store = clone, store
        if self.new_round is not None:
            self.new_round(generation)

    def start(self) -> HangMonitor:
        self._thread = threading.Thread(target=self._run, name="ddpkit-hang-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            t = TIMINGS
            self._thread.join(timeout=self.poll_s + t.launcher_answer_s + t.ack_s + t.store_timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if time.monotonic() < self._quiet_until:
                continue
            try:
                self._tick()
            except RuntimeError:
                # DistError: node 0, the store's host, is gone or cut off. Each failed call prints
                # torch's C++ trace, so try again only now and then; the agent will notice.
                self._quiet_until = time.monotonic() + TIMINGS.quiet_s

    def _tick(self) -> None:
        if self._round is None:
            return
        node_rank, nnodes, exchange, generation = self._round
        if generation != self._seen_generation:
            self._seen_generation, self._ended = generation, False
            self._local.reset()
        local = self._local.states()
        for state in local.values():
            exchange.publish(state)
        if exchange.asked():  # node 0 asks for this node's ranks' stacks
            for rank, stack in dump_stacks(self.run_dir, self._local.pids()).items():
                if rank in local:
                    exchange.answer(local[rank], stack)
        if self._ended:
            return
        if (verdict := exchange.summary()) is not None:
            self._end(verdict, announce=False)
            exchange.ack()  # node 0 may now let its store go
        elif node_rank == 0 and local:
            self._decide(exchange, max(s.world for s in local.values()))
            if self._ended:
                # Keep node 0's store up until every node has read the verdict: a node whose rank
                # spins in Python would otherwise never learn that the job is over.
                exchange.await_acks(nnodes, TIMINGS.ack_s)

    def _decide(self, exchange: Exchange, world: int) -> None:
        states = exchange.states(range(world))
        timeout = self.timeout_s or auto_timeout(states)
        summary = find_hang(states, world, timeout, time.time())
        if summary is None:
            return
        source = "--collective-timeout" if self.timeout_s else AUTO_SOURCE
        # Every rank's stack: this node's directly, the others' through their launchers.
        exchange.request()
        stacks = dump_stacks(self.run_dir, self._local.pids())
        others = set(range(world)) - set(stacks)
        for rank, (_, stack) in exchange.answers(others, TIMINGS.launcher_answer_s).items():
            stacks[rank] = stack
        write_report(
            self.report_path, format_run_report(summary, timeout, world, states, stacks, time.time(), source)
        )
        verdict = (
            f"a collective did not complete within {timeout:g} s ({source}): "
            f"{summary}; every rank's stack is in {self.report_path}"
        )
        exchange.summarize(verdict, str(self.report_path))
        self._end(verdict, announce=self.announce)

    def _end(self, verdict: str, announce: bool) -> None:
        """Kill this node's workers of the hung round; the agent then restarts them or gives up."""
        self.verdict, self._ended = verdict, True
        if announce:  # the agent restarts the workers next: say why here, as no failure will
            print(f"ddpkit: {verdict}; restarting the workers", file=sys.stderr, flush=True)
        for pid in self._local.pids().values():
            if is_our_worker(pid):
                os.kill(pid, signal.SIGKILL)
