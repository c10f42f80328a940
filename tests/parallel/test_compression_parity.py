"""Gradient compression against torch's matching DDP comm hooks, and training that still converges.

bf16 / fp16: torch's ``bf16_compress_hook`` / ``fp16_compress_hook``. PowerSGD: torch's
``powerSGD_hook`` with the same rank, start iteration and seed. Our hooks repeat torch's steps in
the same order, so at world size 2 the results are equal bit for bit, which is the tightest
tolerance there is; a looser one would hide an operation done in a different order.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import powersgd_one_bucket_at_a_time, run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ddpkit import DataParallel
from ddpkit.parallel import PowerSGD

pytestmark = pytest.mark.slow  # each file spawns its ranks once, for a few seconds

BUCKET_MB = 0.01  # several buckets, so per-bucket state (PowerSGD's P, Q and error) is exercised


def _model() -> nn.Module:
    # 64 x 64 matrices are worth compressing at rank 1; biases and the 8-row head are not.
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _torch_engine(model: nn.Module, kind: str) -> DistributedDataParallel:
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd_one_bucket_at_a_time)
    elif kind is not None:
        hook = getattr(default_hooks, f"{kind}_compress_hook")
        # torch refuses bf16_compress_hook by name unless NCCL is there, though gloo reduces
        # bf16 fine on CPU; the same function under another name gets past the check.
        ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
    return ddp


def _our_engine(model: nn.Module, kind: str | None) -> DataParallel:
    compression = PowerSGD(matrix_approximation_rank=1, start_iter=2) if kind == "powersgd" else kind
    return DataParallel(model, bucket_cap_mb=BUCKET_MB, compression=compression)


def _teacher_data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 32, generator=gen)
    teacher = torch.Generator().manual_seed(7)  # the same target function on every rank
    w = torch.randn(32, 8, generator=teacher) / 32**0.5
    return x, torch.tanh(x @ w)


def _train(engine: nn.Module, rank: int, steps: int, lr: float) -> list[float]:
    optimizer = torch.optim.SGD(engine.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = _teacher_data(rank, step)
        loss = F.mse_loss(engine(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _parity(env, kinds: list[str]) -> dict:
    out = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = _model()
        results = []
        for engine in (_torch_engine(copy.deepcopy(model), kind), _our_engine(copy.deepcopy(model), kind)):
            _train(engine, env.rank, steps=6, lr=0.05)
            results.append(
                {n: (p.detach().clone(), p.grad.clone()) for n, p in engine.module.named_parameters()}
            )
        out[kind] = results
    return out


def _convergence(env, kinds: list) -> dict:
    curves = {}
    for kind in kinds:
        torch.manual_seed(0)
        curves[kind] = _train(_our_engine(_model(), kind), env.rank, steps=60, lr=0.05)
    return curves


KINDS = ["bf16", "fp16", "powersgd"]


def _parity_and_convergence(env, kinds: list[str]) -> tuple[dict, dict]:
    return _parity(env, kinds), _convergence(env, [None, *kinds])


@pytest.fixture(scope="module")
def results() -> tuple[list, list]:
    # One spawn for everything: starting processes costs more than these tiny models.
    per_rank = run_ranks(_parity_and_convergence, 2, KINDS)
    return [parity for parity, _ in per_rank], [curves for _, curves in per_rank]


@pytest.mark.parametrize("kind", KINDS)
def test_matches_torch_comm_hook(results, kind: str) -> None:
    for rank_result in results[0]:
        reference, ours = rank_result[kind]
        for name, (param, grad) in reference.items():
            assert torch.equal(param, ours[name][0]), f"{kind}: parameter {name} differs"
            assert torch.equal(grad, ours[name][1]), f"{kind}: gradient {name} differs"


@pytest.mark.parametrize("kind", KINDS)
def test_compressed_training_converges(results, kind: str) -> None:
    curves = results[1][0]
    full, compressed = curves[None], curves[kind]
    assert compressed[-1] < 0.2 * compressed[0], (
        f"{kind} did not learn: {compressed[0]:.4f} -> {compressed[-1]:.4f}"
    )
    # Compression may cost a little accuracy, not the run.
    assert compressed[-1] < 2 * full[-1] + 1e-3, (
        f"{kind} ends at {compressed[-1]:.4f}, full precision {full[-1]:.4f}"
    )


def test_powersgd_compresses_after_start_iter(results) -> None:
    # Not a no-op in disguise: after start_iter the update differs from full precision.
    curves = results[1][0]
    assert curves["powersgd"][:3] == curves[None][:3]  # steps 1 and 2 are plain all-reduces
    assert curves["powersgd"][5] != curves[None][5]
