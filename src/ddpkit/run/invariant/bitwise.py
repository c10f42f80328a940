"""The same bits on 1, 2, 4 ... processes: ``ddpkit.Run(bitwise=True)``.

With every draw keyed by its sample, what still differs between world sizes is where the sums are
cut: each rank sums its share of the batch in one backward, and the all-reduce adds the ranks in
an order the world size sets (a ring, a tree). In this mode the global batch is cut into
``grains`` fixed grains of ``global_batch / grains`` samples, each grain's gradient is made by a
backward of its own (one micro-batch a grain), and the grains' gradients are added in one binary
tree: a rank adds its consecutive grains (``GrainSum``), then the ranks add their subtrees'
sums with a reduce-scatter by recursive halving and an all-gather by recursive doubling whose
pairs follow the same tree (``tree_all_reduce``). On a world of 2^k ranks dividing ``grains``
every rank holds whole subtrees, so the sums are the same tree, hence the same bits, on any such
world size. IEEE addition is commutative: which operand comes first never matters, only how the
terms are grouped, and that is fixed here.

Each grain's loss is weighed by its share of the global batch on every world size (``1 /
grains`` for a mean), and the ranks' sums are added, not averaged, so no factor depends on the
world size either. The kernels are made deterministic where torch has them, with one intra-op
thread per process on the CPU (a CPU kernel's sums follow its thread count).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)


def check_world(grains: int, world_size: int, engine: str, compression: object) -> None:
    """Refuse, in one line, a world or engine on which the tree cannot be the same."""
    if grains % world_size or world_size & (world_size - 1):
        sizes = ", ".join(str(1 << k) for k in range(grains.bit_length()))
        raise ConfigError(
            f"bitwise=True with grains={grains} gives the same bits on {sizes} processes, and this run "
            f"has {world_size}; run on one of those, or raise grains to a power of two at least "
            f"{1 << (world_size - 1).bit_length()}"
        )
    if engine == "fsdp":
        raise ConfigError(
            "bitwise=True needs engine='torch' or 'native': fsdp reduce-scatters the gradients inside "
            "its own backward, grouped as the world size sets"
        )
    if compression is not None:
        raise ConfigError("bitwise=True sums exact gradients; leave compression off")


def grain_size(global_batch: int, grains: int, micro_batch: int | None) -> int:
    """Samples per grain (the micro-batch of every backward), or one line why the batch cannot be cut."""
    if global_batch % grains:
        raise ConfigError(
            f"bitwise=True cuts the global batch into grains={grains} equal grains; global_batch="
            f"{global_batch} does not divide by {grains}: use a multiple of {grains}"
        )
    size = global_batch // grains
    if micro_batch is not None and micro_batch != size:
        raise ConfigError(
            f"bitwise=True runs one backward a grain of {size} samples (global_batch={global_batch} "
            f"/ grains={grains}); leave micro_batch unset (it is {micro_batch})"
        )
    return size


def check_epoch(samples: int, global_batch: int, drop_last: bool) -> None:
    """Refuse an epoch whose last global batch is partial: its grains would not be whole."""
    if samples % global_batch and not drop_last:
        raise ConfigError(
            f"bitwise=True cuts every global batch into the same grains, and the epoch's last batch "
            f"holds {samples % global_batch} of {global_batch} samples; pass drop_last=True to "
            f"ddpkit.Run (ddpkit train: --drop-last), or use a dataset of a multiple of "
            f"{global_batch} samples"
        )


def fix_kernels(device: torch.device) -> Callable[[], None]:
    """Deterministic kernels where torch has them, and on the CPU one intra-op thread per process;
    returns what puts the process's settings back (a Run that closes leaves them as it found them)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS's first handle
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cpu":
        torch.set_num_threads(1)

    def restore() -> None:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_num_threads(threads)

    return restore


class GrainSum:
    """A step's grains' gradients, added in the binary tree as they come: a grain's gradient is
    added to the last partial sum of the same height while there is one, so at most log2 partial
    sums are held, and a rank's grains end as one sum (its subtree's). A parameter a grain left
    without a gradient adds zeros, and the count of grains that gave it one says, at the end,
    whether it gets a gradient at all (none: ``None``, as one process would leave it).

    Args:
        group: the process group the ranks' subtrees are added over (None: the default one).
        restore_kernels: puts back the kernel settings ``fix_kernels`` changed (at the run's close).
    """

    def __init__(self, group: object = None, restore_kernels: Callable[[], None] = lambda: None) -> None:
        self.group, self.restore_kernels = group, restore_kernels
        self.stack: list[tuple[int, list[torch.Tensor], torch.Tensor]] = []
        self.added_in: object = None  # the micro-batch whose gradient was added last
        self.threads_seen = False

    def add(self, params: list[nn.Parameter], micro: object) -> None:
        """After a grain's backward: take its gradients (each ``p.grad`` is None again)."""
        if self.added_in is micro:
            raise ConfigError(
                "bitwise=True adds each grain's gradient once: give run.backward one loss per "
                "micro-batch (run.backward(loss_a + loss_b)), not two backwards"
            )
        self.added_in = micro
        device = params[0].device if params else None
        if not self.threads_seen:  # the first grain: the loop may have set its own count since Run()
            self.threads_seen = True
            if device is not None and device.type == "cpu" and torch.get_num_threads() != 1:
                log.warning(
                    "ddpkit: bitwise=True sets one intra-op thread a process on the CPU and this loop "
                    "runs %d (torch.set_num_threads): the bits then follow the thread count; "
                    "leave it at 1",
                    torch.get_num_threads(),
                )
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.float64, device=device)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for param in params:
            param.grad = None
        height, node, counts = 0, grads, used
        while self.stack and self.stack[-1][0] == height:
            _, left, left_counts = self.stack.pop()
            torch._foreach_add_(left, node)  # left + right, elementwise: the tree's next level
            left_counts += counts
            height, node, counts = height + 1, left, left_counts
        self.stack.append((height, node, counts))

    def finish(self, params: list[nn.Parameter]) -> None:
        """After the step's last grain: the ranks' subtrees added, each gradient set (or None)."""
        if len(self.stack) != 1:
            raise RuntimeError(
                f"a step's grains left {len(self.stack)} partial sums; a rank's grains are a subtree"
            )
        _, sums, counts = self.stack.pop()
        self.added_in = None
        if len(sums) != len(params):
            raise ConfigError(
                "bitwise=True: the trainable parameters changed within a step; freeze or unfreeze "
                "between steps"
            )
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            for same in _by_dtype(sums + [counts]):  # one flat buffer a dtype: one exchange a level
                flat = torch.cat([t.reshape(-1) for t in same])
                tree_all_reduce(flat, self.group)
                for tensor, part in zip(same, flat.split([t.numel() for t in same]), strict=True):
                    tensor.copy_(part.view_as(tensor))
        for param, grad, count in zip(params, sums, counts.tolist(), strict=True):
            param.grad = grad if count else None

    def clear(self) -> None:
        """The loop left mid-step: its grains' gradients are dropped."""
        self.stack, self.added_in = [], None


def _by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return list(groups.values())


def tree_all_reduce(flat: torch.Tensor, group: object = None) -> None:
    """Sum ``flat`` over the ranks of ``group`` (2^k of them), in place, grouped as a binary tree
    over the ranks in order: ((r0 + r1) + (r2 + r3)) + ... on every rank, the same bits.

    A reduce-scatter by recursive halving (partners at distance 1, 2, 4 ...: each pair adds the
    half it keeps, so every element is added up the tree) and an all-gather by recursive doubling
    (distances in reverse: each pair swaps the halves it owns): about the bytes of a ring
    all-reduce, over torch.distributed's point-to-point sends.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return
    padded = -(-flat.numel() // world) * world
    buffer = flat if padded == flat.numel() else torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    low, high, distance = 0, padded, 1
    while distance < world:
        partner = dist.get_global_rank(group, rank ^ distance) if group is not None else rank ^ distance
        middle = (low + high) // 2
        keep, give = (
            ((low, middle), (middle, high)) if not rank & distance else ((middle, high), (low, middle))
        )
        received = buffer.new_empty(keep[1] - keep[0])
        _exchange(buffer[give[0] : give[1]], received, partner, group)
        buffer[keep[0] : keep[1]].add_(received)
        low, high = keep
        distance *= 2
    distance = world // 2
    while distance >= 1:
        partner = dist.get_global_rank(group, rank ^ distance) if group is not None else rank ^ distance
        size = high - low
        theirs = (high, high + size) if not rank & distance else (low - size, low)
        _exchange(buffer[low:high], buffer[theirs[0] : theirs[1]], partner, group)
        low, high = min(low, theirs[0]), max(high, theirs[1])
        distance //= 2
    if buffer is not flat:
        flat.copy_(buffer[: flat.numel()])


def _exchange(send: torch.Tensor, receive: torch.Tensor, partner: int, group: object) -> None:
    """Send ``send`` to ``partner`` and receive its message into ``receive``, as one batch (NCCL
    would deadlock on two blocking halves)."""
    ops = [
        dist.P2POp(dist.isend, send.contiguous(), partner, group),
        dist.P2POp(dist.irecv, receive, partner, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
