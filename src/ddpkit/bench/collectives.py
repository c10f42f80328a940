"""The operations ``ddpkit bench comm`` measures: how to run each, what it must produce, its bus factor.

Each operation builds a ``Case`` for one rank: input tensors filled with small rank-dependent
integers, a ``run`` that communicates once, and the exact output this rank must then hold.
Small integers keep every result exact in every dtype and in any reduction order: reduction
inputs are 1..7, so sums stay small, and PRODUCT inputs are 1 or 2, so products are powers of two.

Sizes and bandwidths follow nccl-tests (its doc/PERFORMANCE.md): ``count`` is the number of
elements of the largest buffer (the gathered or scattered whole for all_gather, reduce_scatter,
gather, scatter and all_to_all), ``algbw = bytes / time``, and ``busbw = algbw * factor`` with
the factor that makes busbw comparable to the link speed: 2(n-1)/n for all_reduce, (n-1)/n for
all_gather, reduce_scatter, gather, scatter and all_to_all, 1 for broadcast, reduce and send/recv.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

REDOPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_COMBINE = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}

# torch 2.13 renamed the flat-tensor forms and deprecates the old names; older torch has only those.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Spec:
    """What one rank needs to build a case.

    Args:
        rank: this process's rank.
        world_size: number of ranks.
        count: elements of the operation's largest buffer (nccl-tests' count column).
        dtype: element type.
        device: where the buffers live (the rank's GPU under nccl, else the CPU).
        redop: ``sum``, ``prod``, ``max`` or ``min`` for reducing operations, else None.
        root: the source or destination rank of rooted operations.
    """

    rank: int
    world_size: int
    count: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    redop: str | None = None
    root: int = 0


@dataclass
class Case:
    """One rank's part of one operation at one size.

    Args:
        run: performs the communication once; safe to call repeatedly (the timing loop does).
        output: the tensor this rank checks after one run; None where the operation defines no
            result on this rank (non-root ranks of reduce and gather).
        expected: the exact value ``output`` must hold after one run from fresh inputs.
    """

    run: Callable[[], None]
    output: Tensor | None
    expected: Tensor | None


def pattern(spec: Spec, rank: int, count: int) -> Tensor:
    """Rank ``rank``'s input: small integers that differ between ranks and along the buffer."""
    # Moved data needs no arithmetic, so a long period tells up to 101 ranks' pieces apart (and
    # 101 fits int8 and bfloat16 exactly); reductions need small values to stay exact.
    period = {None: 101, "prod": 2}.get(spec.redop, 7)
    values = (torch.arange(count, dtype=torch.int32, device=spec.device) + rank) % period + 1
    return values.to(spec.dtype)


def reduced(spec: Spec, count: int) -> Tensor:
    """The exact reduction of every rank's ``pattern`` under ``spec.redop``."""
    combine = _COMBINE[spec.redop]
    acc = pattern(spec, 0, count)
    for rank in range(1, spec.world_size):
        acc = combine(acc, pattern(spec, rank, count))
    return acc


def _piece(spec: Spec) -> int:
    return spec.count // spec.world_size


def _sendrecv(spec: Spec, blocking: bool) -> Case:
    send = pattern(spec, spec.rank, spec.count)
    recv = torch.zeros_like(send)
    nxt, prv = (spec.rank + 1) % spec.world_size, (spec.rank - 1) % spec.world_size

    def run_blocking() -> None:
        # Even ranks send first and odd ranks receive first, so a blocking ring never has
        # every rank stuck in send at once.
        if spec.rank % 2 == 0:
            dist.send(send, nxt)
            dist.recv(recv, prv)
        else:
            dist.recv(recv, prv)
            dist.send(send, nxt)

    def run_async() -> None:
        # Both are posted before either is waited on: no ordering needed, the point of isend/irecv.
        for work in [dist.irecv(recv, prv), dist.isend(send, nxt)]:
            work.wait()

    return Case(run_blocking if blocking else run_async, recv, pattern(spec, prv, spec.count))


def _broadcast(spec: Spec) -> Case:
    source = pattern(spec, spec.root, spec.count)
    buf = source.clone() if spec.rank == spec.root else torch.zeros_like(source)
    return Case(lambda: dist.broadcast(buf, spec.root), buf, source)


def _reduce(spec: Spec) -> Case:
    buf = pattern(spec, spec.rank, spec.count)
    run = partial(dist.reduce, buf, spec.root, op=REDOPS[spec.redop])
    if spec.rank != spec.root:
        return Case(run, None, None)  # a non-root buffer holds partial sums: nothing to check
    return Case(run, buf, reduced(spec, spec.count))


def _all_reduce(spec: Spec) -> Case:
    buf = pattern(spec, spec.rank, spec.count)
    return Case(partial(dist.all_reduce, buf, op=REDOPS[spec.redop]), buf, reduced(spec, spec.count))


def _scatter(spec: Spec) -> Case:
    whole = pattern(spec, spec.root, spec.count)
    out = torch.zeros(_piece(spec), dtype=spec.dtype, device=spec.device)
    chunks = list(whole.chunk(spec.world_size)) if spec.rank == spec.root else None
    return Case(
        lambda: dist.scatter(out, chunks, src=spec.root), out, whole.chunk(spec.world_size)[spec.rank]
    )


def _gathered(spec: Spec) -> Tensor:
    return torch.cat([pattern(spec, rank, _piece(spec)) for rank in range(spec.world_size)])


def _gather(spec: Spec) -> Case:
    mine = pattern(spec, spec.rank, _piece(spec))
    if spec.rank != spec.root:
        return Case(lambda: dist.gather(mine, None, dst=spec.root), None, None)
    out = torch.zeros(spec.count, dtype=spec.dtype, device=spec.device)
    slots = list(out.chunk(spec.world_size))  # views: gather writes straight into ``out``
    return Case(lambda: dist.gather(mine, slots, dst=spec.root), out, _gathered(spec))


def _all_gather(spec: Spec) -> Case:
    mine = pattern(spec, spec.rank, _piece(spec))
    out = torch.zeros(spec.count, dtype=spec.dtype, device=spec.device)
    return Case(lambda: all_gather_flat(out, mine), out, _gathered(spec))


def _reduce_scatter(spec: Spec) -> Case:
    mine = pattern(spec, spec.rank, spec.count)
    out = torch.zeros(_piece(spec), dtype=spec.dtype, device=spec.device)
    expected = reduced(spec, spec.count).chunk(spec.world_size)[spec.rank]
    return Case(lambda: reduce_scatter_flat(out, mine, op=REDOPS[spec.redop]), out, expected)


def _all_to_all(spec: Spec) -> Case:
    mine = pattern(spec, spec.rank, spec.count)
    out = torch.zeros_like(mine)
    # Rank r ends up with chunk r of every rank's input, in rank order.
    parts = [
        pattern(spec, rank, spec.count).chunk(spec.world_size)[spec.rank] for rank in range(spec.world_size)
    ]
    return Case(lambda: dist.all_to_all_single(out, mine), out, torch.cat(parts))


def _one(world_size: int) -> float:
    return 1.0


def _ring(world_size: int) -> float:
    return (world_size - 1) / world_size


def _all_reduce_factor(world_size: int) -> float:
    return 2 * (world_size - 1) / world_size


@dataclass(frozen=True)
class Collective:
    """One measurable operation.

    Args:
        name: its name on the command line and in the table.
        build: makes this rank's ``Case``.
        bus_factor: nccl-tests' busbw / algbw for ``world_size`` ranks.
        reduces: whether it takes a reduce op (and is measured once per ``--redops`` entry).
        rooted: whether one rank is the source or destination (the table's root column).
        split: whether ``count`` is divided among the ranks, so must be a multiple of world_size.
        min_ranks: the fewest ranks it can run on.
    """

    name: str
    build: Callable[[Spec], Case]
    bus_factor: Callable[[int], float]
    reduces: bool = False
    rooted: bool = False
    split: bool = False
    min_ranks: int = 1


COLLECTIVES: dict[str, Collective] = {
    c.name: c
    for c in (
        Collective("sendrecv", partial(_sendrecv, blocking=True), _one, min_ranks=2),
        Collective("isend_irecv", partial(_sendrecv, blocking=False), _one, min_ranks=2),
        Collective("broadcast", _broadcast, _one, rooted=True),
        Collective("reduce", _reduce, _one, reduces=True, rooted=True),
        Collective("all_reduce", _all_reduce, _all_reduce_factor, reduces=True),
        Collective("scatter", _scatter, _ring, rooted=True, split=True),
        Collective("gather", _gather, _ring, rooted=True, split=True),
        Collective("all_gather", _all_gather, _ring, split=True),
        Collective("reduce_scatter", _reduce_scatter, _ring, reduces=True, split=True),
        Collective("all_to_all", _all_to_all, _ring, split=True),
    )
}


def element_count(nbytes: int, element_size: int, world_size: int, split: bool) -> int:
    """Elements for a ``nbytes`` message: at least one, and a multiple of world_size when split."""
    count = max(1, nbytes // element_size)
    if split:
        count = max(world_size, count // world_size * world_size)
    return count


def count_wrong(output: Tensor | None, expected: Tensor | None) -> int:
    """Elements of ``output`` unequal to ``expected`` (NaN counts as wrong); 0 where nothing is defined."""
    if output is None or expected is None:
        return 0
    if output.shape != expected.shape:
        return expected.numel()
    return int((output != expected).sum().item())


def unsupported(collective: Collective, spec: Spec) -> str | None:
    """Run ``collective`` once on a tiny buffer; the backend's error message if it refuses, else None.

    Backends reject what they do not implement when the call is made, on every rank alike, so
    every rank reaches the same verdict without waiting on the others.
    """
    try:
        collective.build(spec).run()
    except (RuntimeError, NotImplementedError) as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None
