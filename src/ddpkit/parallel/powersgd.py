"""PowerSGD: send a rank-r approximation P Q^T of each gradient matrix, with error feedback.

For an n x m gradient M, one power iteration gives P = M Q (n x r) and Q = M^T P (m x r), so a
rank sends (n + m) r numbers instead of n m. What the approximation missed is kept locally
(error feedback) and added to the next step's gradient, which is what lets training converge.
The first ``start_iter`` steps use a plain all-reduce, while gradients are still changing fast.

The steps follow torch's ``powerSGD_hook`` one for one (same grouping by shape, same random
start for Q, same orthogonalization), so the two agree to rounding.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ddpkit.choices import POWERSGD_RANK, POWERSGD_START_ITER, check_powersgd
from ddpkit.parallel.flat import flatten, unflatten


def orthogonalize(matrices: Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of each (n, r) matrix in a (b, n, r) batch orthonormal, in place."""
    batch, _, rank = matrices.shape
    if rank > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        torch.linalg.qr(matrices, out=(matrices, matrices.new_empty(batch, rank, rank)))
        return
    # Gram-Schmidt is cheaper than QR for the usual rank 1 or 2.
    for i in range(rank):
        col = matrices[:, :, i : i + 1]  # (b, n, 1)
        col /= torch.norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGD:
    """Low-rank gradient compression with error feedback, as a communication hook.

    Args:
        matrix_approximation_rank: rank r of the approximation; higher is more accurate and sends
            more (torch's ``PowerSGDState`` name; ``rank=`` is still accepted).
        start_iter: synchronized steps that use a plain all-reduce before compressing (> 1).
        min_compression_rate: compress a matrix only if this saves at least this factor.
        error_feedback: add what the approximation missed to the next step's gradient.
        warm_start: start each step's power iteration from the last step's Q.
        seed: seed for the random first Q, the same on every rank.
        rank: the old name of matrix_approximation_rank.
    """

    def __init__(
        self,
        matrix_approximation_rank: int = POWERSGD_RANK,
        start_iter: int = POWERSGD_START_ITER,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        *,
        rank: int | None = None,
    ) -> None:
        if rank is not None:
            warnings.warn(
                "PowerSGD(rank=...) is deprecated: pass matrix_approximation_rank=..., torch's name",
                FutureWarning,
                stacklevel=2,
            )
            matrix_approximation_rank = rank
        check_powersgd(matrix_approximation_rank, start_iter, error_feedback, warm_start)
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_iter, self.min_compression_rate = start_iter, min_compression_rate
        self.error_feedback, self.warm_start = error_feedback, warm_start
        self.rng = np.random.RandomState(seed)
        self.errors: dict[int, Tensor] = {}
        self.p_memory: dict[int, Tensor] = {}
        self.q_memory: dict[int, Tensor] = {}
        self.steps = 0  # synchronized backward passes seen, counted at bucket 0

    def __call__(self, bucket, process_group: dist.ProcessGroup, divisor: int):
        if bucket.index == 0:
            self.steps += 1
        if self.steps <= self.start_iter:
            # torch's powerSGD_hook divides first here (allreduce_hook), not multiplies.
            bucket.buffer.div_(divisor)
            return dist.all_reduce(bucket.buffer, group=process_group, async_op=True)
        return _PowerSGDStep(self, bucket, process_group, divisor)

    def forget_if_rebuilt(self, index: int, buffer: Tensor) -> None:
        """Drop bucket ``index``'s error and P/Q if the buckets were rebuilt under it (join can delay
        the rebuild past start_iter); the memory would no longer line up with the gradients."""
        error = self.errors.get(index)
        if error is not None and error.numel() != buffer.numel():
            for memory in (self.errors, self.p_memory, self.q_memory):
                memory.pop(index, None)

    def _compressible(self, view: Tensor) -> bool:
        n, m = view.shape[0], view[0].numel()
        r = min(n, m, self.matrix_approximation_rank)
        return (n + m) * r * self.min_compression_rate < n * m


class _PowerSGDStep:
    """One bucket's compression: P is computed and its all-reduce started at once; Q on ``wait``."""

    def __init__(self, state: PowerSGD, bucket, group: dist.ProcessGroup, divisor: int) -> None:
        self.state, self.bucket, self.group, self.divisor = state, bucket, group, divisor
        buffer, index = bucket.buffer, bucket.index
        state.forget_if_rebuilt(index, buffer)
        self.before = self._add_error(buffer, index)
        views = [v if v.dim() > 0 else v.view(1) for v in bucket.views]
        self.plain = [v for v in views if not state._compressible(v)]
        by_shape: dict[torch.Size, list[Tensor]] = {}
        for view in views:
            if state._compressible(view):
                matrix = view.view(view.shape[0], -1)
                by_shape.setdefault(matrix.shape, []).append(matrix)
        # torch groups the matrices by shape (first-seen order); P/Q memory and the random Q follow it.
        self.matrices = [m.unsqueeze(0) for group in by_shape.values() for m in group]  # each (1, n, m)
        self.ps, self.qs = self._low_rank_views(index, buffer)
        for matrix, q, p in zip(self.matrices, self.qs, self.ps, strict=True):
            torch.bmm(matrix, q, out=p)  # (1, n, r)
        self.flat_plain = flatten(self.plain) if self.plain else buffer.new_empty(0)
        self.plain_work = dist.all_reduce(self.flat_plain, group=group, async_op=True)
        self.p_work = dist.all_reduce(state.p_memory[index], group=group, async_op=True)

    def _add_error(self, buffer: Tensor, index: int) -> Tensor | None:
        state = self.state
        if not state.error_feedback:
            return None
        if index in state.errors:
            buffer.add_(state.errors[index])
        else:
            state.errors[index] = torch.zeros_like(buffer)
        return buffer.clone()

    def _low_rank_views(self, index: int, buffer: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        state = self.state
        rank = state.matrix_approximation_rank
        shapes = [(m.shape[1], m.shape[2], min(m.shape[1], m.shape[2], rank)) for m in self.matrices]
        fresh = not state.warm_start or index not in state.p_memory
        if fresh:
            state.p_memory[index] = buffer.new_empty(sum(n * r for n, _, r in shapes))
            state.q_memory[index] = buffer.new_empty(sum(m * r for _, m, r in shapes))
        ps = unflatten(state.p_memory[index], [(1, n, r) for n, _, r in shapes])
        qs = unflatten(state.q_memory[index], [(1, m, r) for _, m, r in shapes])
        if fresh:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(state.rng.randint(1_000_000_000))
                for q in qs:
                    q.copy_(torch.randn(*q.shape, device="cpu", dtype=buffer.dtype))
                    orthogonalize(q)
        else:
            for q in qs:
                orthogonalize(q)
        return ps, qs

    def wait(self) -> None:
        state, index = self.state, self.bucket.index
        self.plain_work.wait()
        self.flat_plain.div_(self.divisor)
        for view, reduced in zip(self.plain, unflatten(self.flat_plain, self.plain), strict=True):
            view.copy_(reduced)
        self.p_work.wait()
        for p in self.ps:
            orthogonalize(p)
        for matrix, p, q in zip(self.matrices, self.ps, self.qs, strict=True):
            torch.bmm(matrix.transpose(1, 2), p, out=q)  # (1, m, r)
        dist.all_reduce(state.q_memory[index], group=self.group)
        state.q_memory[index].div_(self.divisor)
        for p, q, matrix in zip(self.ps, self.qs, self.matrices, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=matrix)  # (1, n, m), written into the bucket
        if self.before is not None:
            state.errors[index] = self.before - self.bucket.buffer
        if not state.warm_start:
            state.p_memory.clear()
            state.q_memory.clear()
