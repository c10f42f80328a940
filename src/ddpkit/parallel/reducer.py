"""The Reducer: turns per-parameter "gradient ready" signals into bucketed, overlapped all-reduces.

One synchronized backward pass, as a state machine:

    idle ---- prepare_for_backward (end of a forward that syncs) ----> armed (a new Pass)
    armed --- first gradient hook: queue the end-of-backward callback,
              start the used-map all-reduce and count unused parameters as ready -> reducing
    reducing  each hook moves one gradient into its bucket; full buckets start their
              collective at once, strictly in bucket order (every rank must issue the
              same collectives in the same order, or gloo pairs up the wrong ones)
    reducing - end-of-backward callback: wait for every bucket, write back -> idle

The average is a sum of pre-scaled gradients: the default hook has each gradient multiplied by
1 / world_size as it is copied into its bucket (torch DDP's own order of operations, so the
rounding is the same), then the all-reduce sums in place.

find_unused_parameters: a parameter the forward's output cannot reach is counted as ready at
the first hook, contributing whatever gradient it holds (zeros if none). Which parameters were
used on *any* rank since the last synchronized pass, ``no_sync`` micro-batches included, is
all-reduced (the used map); a parameter no rank used keeps its ``.grad`` untouched, one that
some rank used gets the average, as in torch's DDP.

static_graph: the first synchronized pass only records how often each parameter's hook fires
(activation checkpointing may fire it twice) and reduces everything at its end; later passes
reduce a parameter when its hook has fired that often, with no graph walk and no used map.

A pass that ends with a parameter still pending (it got no gradient and
``find_unused_parameters`` is off) leaves an error that the next forward raises.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable

from ddpkit.parallel.bucket import FIRST_BUCKET_BYTES, Bucket, assign_buckets
from ddpkit.parallel.compression import CommHook
from ddpkit.parallel.errors import DataParallelError
from ddpkit.parallel.graph import reachable_params


@dataclass
class Pass:
    """The state of one synchronized backward pass, from ``prepare_for_backward`` to its end.

    Args:
        expected: hook firings per parameter before its gradient is final (None: record them).
        unused: parameters that will get no gradient in this pass.
    """

    expected: list[int] | None
    unused: list[int]
    fired: list[int] = field(default_factory=list)  # hook firings so far, per parameter
    started: bool = False  # the first hook ran: callback queued, unused parameters counted
    next_bucket: int = 0  # buckets are launched strictly in this order
    used_map: tuple[dist.Work, Tensor] | None = None


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
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.group, self.world_size = process_group, dist.get_world_size(process_group)
        self.set_hook(hook)
        self.find_unused, self.static_graph = find_unused_parameters, static_graph
        self.grad_as_view = gradient_as_bucket_view
        # A small first bucket starts communication early in backward (torch DDP's 1 MiB); a small
        # last bucket shortens the one all-reduce that cannot overlap with backward at all.
        small = min(first_bucket_bytes, bucket_cap_bytes)
        self.caps = (small, bucket_cap_bytes, small if small < bucket_cap_bytes else 0)
        # Before any backward, reverse registration order is the best guess of arrival order.
        self._build(list(reversed(range(len(self.params)))))
        # Arrival order, recorded in the first pass, then used to rebuild once; like torch, not
        # when unused parameters are searched for every pass (their order varies).
        self.arrival: list[int] | None = [] if static_graph or not find_unused_parameters else None
        self.rebuild_pending = False
        self.current: Pass | None = None  # None: idle
        self.error: DataParallelError | None = None
        self.locally_used = [False] * len(self.params)  # since the last synchronized pass
        self.static_counts: list[int] | None = None  # static_graph: hook firings per pass
        self.used_anywhere: list[bool] | None = None  # static_graph: the first pass's used map
        # Autograd runs each device's part of backward on its own thread, so a replica spanning
        # two GPUs calls the hooks concurrently; the ready counts and launch order need a lock.
        self._lock = threading.Lock()
        me = weakref.ref(self)  # the hooks live on the user's parameters; do not keep us alive
        self._hooks = [
            p.register_post_accumulate_grad_hook(_grad_hook(me, i)) for i, p in enumerate(self.params)
        ]

    def set_hook(self, hook: CommHook) -> None:
        """Reduce buckets with ``hook`` from the next pass on."""
        self.hook = hook
        self.copy_scale = 1.0 / self.world_size if getattr(hook, "scale_on_copy", False) else None

    def _build(self, order: list[int]) -> None:
        groups = assign_buckets(self.params, order, *self.caps)
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
        """Raise the error the last backward pass left (a parameter that got no gradient)."""
        error, self.error = self.error, None
        if error is not None:
            raise error

    def prepare_for_backward(self, outputs: Sequence[Tensor]) -> None:
        """Arm the hooks for the backward pass of the forward that produced ``outputs``."""
        for bucket in self.buckets:
            bucket.reset()
        if self.static_graph:
            expected, unused = self.static_counts, self.static_unused
        else:
            expected = [1] * len(self.params)
            unused = []
            if self.find_unused:
                used = reachable_params(outputs)
                unused = [i for i, p in enumerate(self.params) if id(p) not in used]
        self.current = Pass(expected, unused, fired=[0] * len(self.params))

    @property
    def static_unused(self) -> list[int]:
        """static_graph: the parameters this rank's first pass gave no gradient."""
        return [i for i, count in enumerate(self.static_counts or ()) if count == 0]

    def rebuild_buckets(self) -> bool:
        """Once, after the first pass: rebuild the buckets in the order gradients really arrived.

        Rank 0's order is broadcast, so every rank builds the same buckets. A collective: every
        rank calls this at the same point (the forward after the first synchronized backward).
        """
        if not self.rebuild_pending:
            return False
        seen = set(self.arrival or ())
        rest = [i for i in reversed(range(len(self.params))) if i not in seen]
        order = torch.tensor((self.arrival or []) + rest, dtype=torch.int64, device=self.params[0].device)
        dist.broadcast(order, group=self.group, group_src=0)
        old_slots = self.slots
        self._build(order.tolist())
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
            raise RuntimeError(
                f"DataParallel: parameter {self.names[index]!r} received a gradient more often than "
                f"expected ({now.fired[index]} > {now.expected[index]}) in one backward pass; call "
                "backward once per forward (or run extra passes inside no_sync()), or pass "
                "static_graph=True if activation checkpointing reuses it in one backward pass"
            )
        if now.fired[index] < now.expected[index]:
            return
        self._add(now, index, unused=False)

    def _add(self, now: Pass, index: int, unused: bool) -> None:
        if self.arrival is not None and not unused:
            self.arrival.append(index)
        bucket, pos = self.slots[index]
        full = bucket.add_unused(pos, self.copy_scale) if unused else bucket.add_grad(pos, self.copy_scale)
        if full:
            self._launch_ready(now)

    def _start_pass(self, now: Pass) -> None:
        now.started = True
        # Runs once the whole backward graph is done, on the thread that called backward().
        Variable._execution_engine.queue_callback(self._finish_pass)
        if now.expected is None:
            return
        if self.uses_used_map:
            # Started before any bucket, so it overlaps with them; every rank starts it here.
            used = list(self.locally_used)
            for index in set(range(len(used))) - set(now.unused):
                used[index] = True
            now.used_map = _all_reduce_used(used, self)
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
        assert now is not None and now.started, "end-of-backward callback without a started pass"
        if now.expected is None:
            self._end_recording(now)
        if any(bucket.pending for bucket in self.buckets):
            self._fail_pass(now)
            return
        for bucket in self.buckets:  # in order: a serial hook's next bucket waits for this one
            if not bucket.launched:
                bucket.launch(self.hook, self.group, self.world_size)
            bucket.wait()
        used_anywhere = self.used_anywhere
        if now.used_map is not None:
            now.used_map[0].wait()
            used_anywhere = [count > 0 for count in now.used_map[1].tolist()]
            self.locally_used = [False] * len(self.params)
        self._write_back(used_anywhere)
        if self.arrival is not None:
            self.rebuild_pending = True

    def _end_recording(self, now: Pass) -> None:
        """static_graph's first pass ends: keep its counts, then reduce everything at once."""
        self.static_counts = list(now.fired)
        # A gradient is final at its parameter's last hook: order by that.
        last_first = dict.fromkeys(reversed(self.arrival or range(len(self.params))))
        used_here = [i for i in reversed(last_first) if now.fired[i] > 0]
        if self.arrival is not None:
            self.arrival = used_here
        work, used = _all_reduce_used(self.locally_used, self)
        work.wait()
        self.used_anywhere = [count > 0 for count in used.tolist()]
        self.locally_used = [False] * len(self.params)
        for index in used_here:
            self.slots[index][0].add_grad(self.slots[index][1], self.copy_scale)
        for index in self.static_unused:
            self.slots[index][0].add_unused(self.slots[index][1], self.copy_scale)

    def _write_back(self, used_anywhere: list[bool] | None) -> None:
        with torch.no_grad():
            for bucket in self.buckets:
                for pos, index in enumerate(bucket.indices):
                    # Used on no rank: .grad stays exactly as it was, as in torch's DDP.
                    if used_anywhere is None or used_anywhere[index]:
                        bucket.write_back(pos, self.copy_scale)

    def _fail_pass(self, now: Pass) -> None:
        expected = now.expected or [1] * len(self.params)
        missing = [self.names[i] for i, n in enumerate(now.fired) if n < expected[i] and i not in now.unused]
        # The started collectives are left to finish on their own: waiting could hang if the
        # ranks disagree on which buckets filled up.
        for bucket in self.buckets:
            bucket.abandon()
        self.error = DataParallelError(
            f"DataParallel: {len(missing)} parameter(s) got no gradient in the last backward pass, "
            f"so their buckets were never reduced: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}. Pass find_unused_parameters=True to "
            "DataParallel if the model leaves some parameters out of the loss, or remove them"
        )

    # -- join ------------------------------------------------------------------------------------

    def shadow_backward(self) -> None:
        """On a rank that ran out of data: issue the collectives of one backward, with zeros.

        Its own gradients are overwritten with zeros (the bucket buffers are reused); they are
        stale anyway, and the final model is broadcast from a rank that kept training.
        """
        if self.uses_used_map:
            _all_reduce_used([False] * len(self.params), self)[0].wait()
        for bucket in self.buckets:
            bucket.zero_for_join()
            bucket.launch(self.hook, self.group, self.world_size)
            if getattr(self.hook, "serial", False):
                bucket.wait()
        for bucket in self.buckets:
            if bucket.launched:
                bucket.wait()
        if self.arrival is not None:
            self.rebuild_pending = True


def _all_reduce_used(used: list[bool], reducer: Reducer) -> tuple[dist.Work, Tensor]:
    flags = torch.tensor(used, dtype=torch.int32, device=reducer.params[0].device)
    return dist.all_reduce(flags, group=reducer.group, async_op=True), flags


def _grad_hook(reducer: weakref.ref, index: int):
    def hook(param: Tensor) -> None:
        live = reducer()
        if live is not None:
            live.on_grad_ready(index)

    return hook
