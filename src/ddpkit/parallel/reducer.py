"""The Reducer: turns per-parameter "gradient ready" signals into bucketed, overlapped all-reduces.

One synchronized backward pass, as a state machine:

    idle ---- prepare_for_backward (end of a forward that syncs) ----> armed
    armed --- first gradient hook: queue the end-of-backward callback -> reducing
    reducing  each hook moves one gradient into its bucket; full buckets start their
              all-reduce at once, strictly in bucket order (every rank must issue the
              same collectives in the same order, or gloo pairs up the wrong ones)
    reducing - end-of-backward callback: wait for every handle -------> idle

The average is a sum of pre-scaled gradients: the default hook has each gradient multiplied by
1 / world_size as it is copied into its bucket (torch DDP's own order of operations, so the
rounding is the same), then the all-reduce sums in place.

A pass that ends with a parameter still pending (it got no gradient and
``find_unused_parameters`` is off) leaves an error that the next forward raises.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable

from ddpkit.errors import ConfigError
from ddpkit.parallel.bucket import FIRST_BUCKET_BYTES, Bucket, assign_buckets
from ddpkit.parallel.compression import CommHook, Handle


class Reducer:
    """Buckets the gradients of ``params`` and averages them across ``process_group`` in backward.

    Args:
        named_params: (name, parameter) pairs that require grad, in registration order.
        process_group: the ranks that average their gradients.
        hook: how a full bucket is averaged (see ``ddpkit.parallel.compression``).
        bucket_cap_bytes: size at which a bucket is closed.
        find_unused_parameters: walk the graph after each forward to find parameters that will get
            no gradient, and count them as ready (with zeros) instead of waiting for them.
        first_bucket_bytes: size of the small first and last buckets (at most bucket_cap_bytes).
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
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.group, self.hook = process_group, hook
        self.world_size = dist.get_world_size(process_group)
        self.copy_scale = 1.0 / self.world_size if getattr(hook, "scale_on_copy", False) else None
        self.find_unused = find_unused_parameters
        # A small first bucket starts communication early in backward (torch DDP's 1 MiB); a small
        # last bucket shortens the one all-reduce that cannot overlap with backward at all.
        small = min(first_bucket_bytes, bucket_cap_bytes)
        self.caps = (small, bucket_cap_bytes, small if small < bucket_cap_bytes else 0)
        # Before any backward, reverse registration order is the best guess of arrival order.
        self._build(list(reversed(range(len(self.params)))))
        self.arrival: list[int] | None = []  # recorded in the first pass, then used to rebuild once
        self.rebuild_pending = False
        self.armed = self.callback_queued = False
        self.error: ConfigError | None = None
        self.ready = [False] * len(self.params)
        self.unused: list[int] = []
        self.handles: list[Handle] = []
        self.next_bucket = 0
        self._used_work: tuple[dist.Work, Tensor] | None = None
        # Autograd runs each device's part of backward on its own thread, so a replica spanning
        # two GPUs calls the hooks concurrently; the ready counts and launch order need a lock.
        self._lock = threading.Lock()
        me = weakref.ref(self)  # the hooks live on the user's parameters; do not keep us alive
        self._hooks = [
            p.register_post_accumulate_grad_hook(_grad_hook(me, i)) for i, p in enumerate(self.params)
        ]

    def _build(self, order: list[int]) -> None:
        groups = assign_buckets(self.params, order, *self.caps)
        self.buckets = [Bucket(k, [self.params[i] for i in group], group) for k, group in enumerate(groups)]
        self.slots = {i: (bucket, pos) for bucket in self.buckets for pos, i in enumerate(bucket.indices)}

    def remove_hooks(self) -> None:
        """Detach from the parameters; the reducer does nothing after this."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- forward side ---------------------------------------------------------------------------

    def raise_pending_error(self) -> None:
        """Raise the error the last backward pass left (a parameter that got no gradient)."""
        error, self.error = self.error, None
        if error is not None:
            raise error

    def prepare_for_backward(self, outputs: Sequence[Tensor]) -> None:
        """Arm the hooks for the backward pass of the forward that produced ``outputs``."""
        self.armed = True
        self.ready = [False] * len(self.params)
        self.next_bucket, self.handles = 0, []
        for bucket in self.buckets:
            bucket.reset()
        if self.find_unused:
            used = reachable_params(outputs)
            self.unused = [i for i, p in enumerate(self.params) if id(p) not in used]

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
        if not self.armed:
            return  # inside no_sync(), or a forward that ran without grad sync
        with self._lock:
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if not self.callback_queued:
            self._start_pass()
        if self.ready[index]:
            raise RuntimeError(
                f"DataParallel: parameter {self.names[index]!r} received a gradient twice in one "
                "backward pass; call backward once per forward (or run extra passes inside no_sync())"
            )
        self.ready[index] = True
        if self.arrival is not None:
            self.arrival.append(index)
        bucket, pos = self.slots[index]
        if bucket.take_grad(pos, self.copy_scale):
            self._launch_full_buckets()

    def _start_pass(self) -> None:
        self.callback_queued = True
        # Runs once the whole backward graph is done, on the thread that called backward().
        Variable._execution_engine.queue_callback(self._finish_pass)
        if not self.find_unused:
            return
        # Which parameters did any rank use? Started first so it overlaps with the buckets.
        used = torch.ones(len(self.params), dtype=torch.int32, device=self.params[0].device)
        used[self.unused] = 0
        self._used_work = (dist.all_reduce(used, group=self.group, async_op=True), used)
        for index in self.unused:
            self.ready[index] = True
            bucket, pos = self.slots[index]
            if bucket.skip_param(pos, self.copy_scale):
                self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            bucket = self.buckets[self.next_bucket]
            self.handles.append(self.hook(bucket, self.group, self.world_size))
            self.next_bucket += 1

    def _finish_pass(self) -> None:
        self.armed = self.callback_queued = False
        if self.next_bucket < len(self.buckets):
            self._fail_pass()
            return
        for handle in self.handles:
            handle.wait()
        self.handles = []
        if self._used_work is not None:
            self._restore_globally_unused()
        if self.arrival is not None:
            self.rebuild_pending = True

    def _fail_pass(self) -> None:
        missing = [self.names[i] for i, ready in enumerate(self.ready) if not ready]
        # The started all-reduces are left to finish on their own: waiting could hang if the
        # ranks disagree on which buckets filled up.
        self.handles, self._used_work = [], None
        self.error = ConfigError(
            f"DataParallel: {len(missing)} parameter(s) got no gradient in the last backward pass, "
            f"so their buckets were never reduced: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}. Pass find_unused_parameters=True to "
            "DataParallel if the model leaves some parameters out of the loss, or remove them"
        )

    def _restore_globally_unused(self) -> None:
        work, used = self._used_work
        self._used_work = None
        work.wait()
        used_anywhere = used.tolist()
        for index in self.unused:
            bucket, pos = self.slots[index]
            # Used on some rank: take the average (a rank that skipped it sent zeros). Used on
            # none: leave .grad exactly as it was, as torch DDP does.
            if used_anywhere[index] > 0:
                self.params[index].grad = bucket.views[pos]

    # -- join ------------------------------------------------------------------------------------

    def shadow_backward(self) -> None:
        """On a rank that ran out of data: issue the collectives of one backward, with zeros.

        Its own gradients are overwritten with zeros (the bucket buffers are reused); they are
        stale anyway, and the final model is broadcast from a rank that kept training.
        """
        if self.find_unused:
            unused = torch.zeros(len(self.params), dtype=torch.int32, device=self.params[0].device)
            dist.all_reduce(unused, group=self.group)
        handles = []
        for bucket in self.buckets:
            bucket.buffer.zero_()
            handles.append(self.hook(bucket, self.group, self.world_size))
        for handle in handles:
            handle.wait()
        if self.arrival is not None:
            self.rebuild_pending = True


def _grad_hook(reducer: weakref.ref, index: int):
    def hook(param: Tensor) -> None:
        live = reducer()
        if live is not None:
            live.on_grad_ready(index)

    return hook


def reachable_params(outputs: Sequence[Tensor]) -> set[int]:
    """The ``id`` of every leaf tensor (parameter) that backward from ``outputs`` will reach.

    A walk over ``grad_fn.next_functions``; an ``AccumulateGrad`` node holds its leaf in
    ``.variable``. Parameters it does not reach will get no gradient in this pass.
    """
    found = {id(t) for t in outputs if t.grad_fn is None and t.requires_grad}
    seen: set[object] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return found
