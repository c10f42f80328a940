"""The Reducer: turns per-parameter "gradient ready" signals into bucketed, overlapped all-reduces.

One synchronized backward pass, as a state machine:

    idle ---- prepare_for_backward (end of a forward that syncs) ----> armed (a new Pass)
    armed --- first gradient hook: start the used-map all-reduce and count
              unused parameters as ready -----------------------------> reducing
    reducing  each hook moves one gradient into its bucket; full buckets start their
              collective at once, strictly in bucket order (every rank must issue the
              same collectives in the same order, or gloo pairs up the wrong ones);
              the last gradient queues the end-of-backward callback
    reducing - end-of-backward callback: wait for every bucket, write back -> idle
    idle ---- next forward: buckets rebuilt in arrival order after the first pass, and on the
              CPU in each layout the trial tries (``ddpkit.parallel.layout``) until it chooses

The average is a sum of pre-scaled gradients: the default hook has each gradient multiplied by
1 / world_size as it is copied into its bucket (torch DDP's order of operations, so the same
rounding), then the all-reduce sums in place.

find_unused_parameters: a parameter the forward's output cannot reach is counted as ready at
the first hook, contributing whatever gradient it holds (zeros if none). Which parameters were
used on *any* rank since the last synchronized pass, ``no_sync`` micro-batches included, is
all-reduced (the used map); a parameter no rank used keeps its ``.grad`` untouched, one that
some rank used gets the average, as in torch's DDP.

static_graph: the first synchronized pass only records how often each parameter's hook fires
(activation checkpointing may fire it twice) and reduces everything at its end; later passes
reduce a parameter when its hook has fired that often, with no graph walk and no used map.

A pass that started but never got all its gradients (a parameter got no gradient and
``find_unused_parameters`` is off) is reported by the next forward, as torch's DDP does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddpkit.parallel.bucket import FIRST_BUCKET_BYTES, Bucket, CommHook, assign_buckets
from ddpkit.parallel.errors import ready_too_often, unfinished_pass
from ddpkit.parallel.graph import reachable_params
from ddpkit.parallel.layout import broadcast_plan, plan_layout, rebuild_safe
from ddpkit.parallel.passes import Pass, Sink, all_reduce_used, grad_hooks


class Reducer:
    """Buckets the gradients of ``params`` and averages them across ``process_group`` in backward.

    Args:
        named_params: (name, parameter) pairs that require grad, in registration order.
        process_group: the ranks that average their gradients.
        hook: how a full bucket is averaged (see ``ddpkit.parallel.compression``).
        bucket_cap_bytes: size at which a bucket is closed.
        find_unused_parameters: walk the graph after each forward to find parameters that will get
            no gradient, and count them as ready instead of waiting for them.
        first_bucket_bytes: size of the small first and last buckets (at most bucket_cap_bytes).
        auto_layout: ignore first_bucket_bytes; try one bucket and buckets of a few MiB in the
            first passes and keep the faster (``ddpkit.parallel.layout``).
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket.
        static_graph: learn in the first pass which parameters backward reaches, and how often.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        process_group: dist.ProcessGroup,
        hook: CommHook,
        *,
        bucket_cap_bytes: int,
        find_unused_parameters: bool = False,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        auto_layout: bool = False,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.group, self.world_size = process_group, dist.get_world_size(process_group)
        self.find_unused, self.static_graph = find_unused_parameters, static_graph
        self.grad_as_view = gradient_as_bucket_view
        # Layouts are tried where rebuilds are cheap and safe: not with a varying graph.
        auto = auto_layout and not find_unused_parameters and not static_graph and self.world_size > 1
        self.layout, self.trial = plan_layout(self.params, first_bucket_bytes, bucket_cap_bytes, auto)
        self.set_hook(hook)
        # Before any backward, reverse registration order is the best guess of arrival order.
        self._build(list(reversed(range(len(self.params)))))
        # Arrival order, recorded in the first pass, then used to rebuild once; like torch, not
        # when unused parameters are searched for every pass (their order varies).
        self.arrival: list[int] | None = [] if static_graph or not find_unused_parameters else None
        self.rebuild_pending = False
        self.current: Pass | None = None  # None: idle
        self.locally_used = [False] * len(self.params)  # since the last synchronized pass
        self.static_counts: list[int] | None = None  # static_graph: hook firings per pass
        self.used_anywhere: list[bool] | None = None  # static_graph: the first pass's used map
        # Autograd runs each device's part of backward on its own thread, so a replica spanning
        # two GPUs calls the hooks concurrently; the ready counts and launch order need a lock.
        self._lock = threading.Lock()
        self._hooks = grad_hooks(self, self.params)

    def set_hook(self, hook: CommHook) -> None:
        """Reduce buckets with ``hook`` from the next pass on."""
        self.hook = hook
        if self.trial is not None and not rebuild_safe(hook, self.trial):
            self.trial = None  # torch's hooks keep state per bucket index: keep the layout
        self.copy_scale = 1.0 / self.world_size if getattr(hook, "scale_on_copy", False) else None

    def _build(self, order: list[int]) -> None:
        self.order = order
        layout = self.layout
        groups = assign_buckets(self.params, order, layout.first_bytes, layout.cap_bytes, layout.last_bytes)
        self.buckets = [
            Bucket(k, [self.params[i] for i in group], group, self.grad_as_view, k == len(groups) - 1)
            for k, group in enumerate(groups)
        ]
        self.slots = {i: (bucket, pos) for bucket in self.buckets for pos, i in enumerate(bucket.indices)}

    def remove_hooks(self) -> None:
        """Detach from the parameters; the reducer does nothing after this."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def recording(self) -> bool:
        """static_graph before its first synchronized pass: hooks are counted, not reduced."""
        return self.static_graph and self.static_counts is None

    @property
    def uses_used_map(self) -> bool:
        """Whether a synchronized pass all-reduces the map of parameters used on each rank."""
        return self.recording or (self.find_unused and not self.static_graph)

    # -- forward side ---------------------------------------------------------------------------

    def raise_pending_error(self) -> None:
        """Raise if the last backward pass started but some parameter never got its gradient."""
        now = self.current
        if now is None or not now.started or now.waiting == 0:
            return  # an armed pass whose backward has not begun stays armed, as in torch's DDP
        self.current = None
        expected = now.expected or [1] * len(self.params)
        missing = [self.names[i] for i, n in enumerate(now.fired) if n < expected[i] and i not in now.unused]
        # Started collectives are left to finish on their own: waiting could hang if the ranks
        # disagree on which buckets filled up.
        for bucket in self.buckets:
            bucket.abandon()
        raise unfinished_pass(missing)

    def prepare_for_backward(self, outputs: Sequence[Tensor]) -> None:
        """Arm the hooks for the backward pass of the forward that produced ``outputs``."""
        for bucket in self.buckets:
            bucket.reset()
        unused = []
        if self.static_graph:
            unused = [i for i, count in enumerate(self.static_counts or ()) if count == 0]
        elif self.find_unused:
            used = reachable_params(outputs)
            unused = [i for i, p in enumerate(self.params) if id(p) not in used]
        expected = self.static_counts if self.static_graph else [1] * len(self.params)
        n = len(self.params)
        self.current = Pass(expected, unused, fired=[0] * n, waiting=n, armed_at=time.perf_counter())

    def sink(self, outputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """static_graph's first pass: route ``outputs`` through the node that ends the pass."""
        assert self.recording and self.current is not None, "sink() is for static_graph's first pass"
        now = self.current
        return Sink.apply(lambda: now.queue_end(self._finish_pass), *outputs)

    def rebuild_buckets(self) -> bool:
        """After the first pass: rebuild the buckets in the order gradients really arrived; during
        a layout trial, after each of its passes, in the layout it tries next.

        Rank 0's order and layout are broadcast, so every rank builds the same buckets. A
        collective: every rank calls this at the same points (the forwards after synchronized
        backward passes, which every rank counts alike).
        """
        trial = self.trial if self.trial is not None and self.trial.due() else None
        if not (self.rebuild_pending or trial):
            return False
        order = self.order
        if self.rebuild_pending:
            seen = set(self.arrival or ())
            order = (self.arrival or []) + [i for i in reversed(range(len(self.params))) if i not in seen]
        order, index = broadcast_plan(order, trial, self.group, self.params[0].device)
        if trial is not None:
            self.layout = trial.candidates[index]
        old_slots = self.slots
        self._build(order)
        for i, (old_bucket, old_pos) in old_slots.items():
            bucket, pos = self.slots[i]
            bucket.rebind_from(old_bucket, old_pos, pos)
        self.arrival, self.rebuild_pending = None, False
        return True

    # -- backward side --------------------------------------------------------------------------

    def on_grad_ready(self, index: int) -> None:
        """Post-accumulate-grad hook of parameter ``index``: its ``.grad`` is final for this pass."""
        if self.uses_used_map:
            self.locally_used[index] = True  # no_sync passes too: their gradients are averaged later
        if self.current is None:
            return  # inside no_sync(), or a forward that ran without grad sync
        with self._lock:
            self._mark_ready(self.current, index)

    def _mark_ready(self, now: Pass, index: int) -> None:
        if not now.started:
            self._start_pass(now)
        now.fired[index] += 1
        if now.expected is None:  # static_graph's first pass: everything is reduced at its end
            if self.arrival is not None:
                self.arrival.append(index)
            return
        if now.fired[index] > now.expected[index]:
            raise ready_too_often(self.names[index], now.fired[index], now.expected[index])
        if now.fired[index] == now.expected[index]:
            self._add(now, index, unused=False)

    def _add(self, now: Pass, index: int, unused: bool) -> None:
        if self.arrival is not None and not unused:
            self.arrival.append(index)
        bucket, pos = self.slots[index]
        full = bucket.add_unused(pos, self.copy_scale) if unused else bucket.add_grad(pos, self.copy_scale)
        now.waiting -= 1
        if full:
            self._launch_ready(now)
        if now.waiting == 0:
            now.ready_at = time.perf_counter()
            now.queue_end(self._finish_pass)

    def _start_pass(self, now: Pass) -> None:
        now.started = True
        if now.expected is None:
            return
        if self.uses_used_map:
            # Started before any bucket, so it overlaps with them; every rank starts it here.
            used = [was_used or i not in now.unused for i, was_used in enumerate(self.locally_used)]
            now.used_map = all_reduce_used(used, self.params[0].device, self.group)
        for index in now.unused:
            self._add(now, index, unused=True)

    def _launch_ready(self, now: Pass) -> None:
        serial = getattr(self.hook, "serial", False)
        while now.next_bucket < len(self.buckets) and self.buckets[now.next_bucket].pending == 0:
            if serial and now.next_bucket > 0 and not self.buckets[now.next_bucket - 1].done():
                return  # launched later, by a later hook or at the end of backward
            self.buckets[now.next_bucket].launch(self.hook, self.group, self.world_size)
            now.next_bucket += 1

    def _finish_pass(self) -> None:
        now, self.current = self.current, None
        assert now is not None and now.queued, "end-of-backward callback without a queued pass"
        if now.expected is None:
            self._end_recording(now)
        assert now.waiting == 0, f"the pass ended with {now.waiting} gradient(s) not in their buckets"
        for bucket in self.buckets:  # in order: a serial hook's next bucket waits for this one
            if not bucket.launched:
                bucket.launch(self.hook, self.group, self.world_size)
            bucket.wait()
        used_anywhere = self.used_anywhere
        if now.used_map is not None:
            now.used_map[0].wait()
            used_anywhere = [count > 0 for count in now.used_map[1].tolist()]
            self.locally_used = [False] * len(self.params)
        with torch.no_grad():
            for bucket in self.buckets:
                for pos, index in enumerate(bucket.indices):
                    # Used on no rank: .grad stays exactly as it was, as in torch's DDP.
                    if used_anywhere is None or used_anywhere[index]:
                        bucket.write_back(pos, self.copy_scale)
        if self.arrival is not None:
            self.rebuild_pending = True
        if self.trial is not None:
            end = time.perf_counter()
            self.trial.pass_done(end - now.armed_at, end - (now.ready_at or end))

    def _end_recording(self, now: Pass) -> None:
        """static_graph's first pass ends: keep its counts, then fill every bucket at once."""
        self.static_counts = list(now.fired)
        work, used = all_reduce_used(self.locally_used, self.params[0].device, self.group)
        work.wait()
        self.used_anywhere = [count > 0 for count in used.tolist()]
        self.locally_used = [False] * len(self.params)
        # A gradient is final at its parameter's last hook: arrival is ordered by that.
        last_first = dict.fromkeys(reversed(self.arrival or range(len(self.params))))
        used_here = [i for i in reversed(last_first) if now.fired[i] > 0]
        if self.arrival is not None:
            self.arrival = used_here
        for index in used_here:
            self.slots[index][0].add_grad(self.slots[index][1], self.copy_scale)
        for index in (i for i, count in enumerate(now.fired) if count == 0):
            self.slots[index][0].add_unused(self.slots[index][1], self.copy_scale)
        now.waiting = 0
