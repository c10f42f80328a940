"""The native engine against torch's DistributedDataParallel on CUDA: 2 ranks sharing cuda:0 over gloo.

NCCL refuses two ranks on one GPU, gloo takes CUDA tensors (it stages them through host memory),
so one GPU is enough for a real 2-rank all-reduce of CUDA gradients. ddpkit itself computes on
the CPU under gloo (``dist/init.py``: only nccl gets ``cuda:LOCAL_RANK``, and rank 1's would be
cuda:1), so each rank hands ``run.engine.wrap`` -- what ``run.setup`` calls with
``engine="torch"`` or ``engine="native"`` -- its DistEnv with the device replaced by cuda:0.

Each rank builds one model per case, deep-copies it for each engine, and trains both on the same
batches (different on each rank), two micro-batches a step, the first without gradient sync
(the flag no_sync() sets, as ddpkit.Run sets it). At world
size 2 both engines halve before a two-term sum, which is exact, as on the CPU
(tests/parallel/test_engine_parity.py); the tolerance, 1e-5 of each tensor's largest element,
only allows for a GPU kernel that sums in another order between two calls (SGD, not AdamW,
so such rounding is not blown up to a learning-rate-sized step).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from torch import Tensor, nn

from ddpkit.models import GPT, ConvNet, GPTConfig
from ddpkit.run import EngineConfig
from ddpkit.run.engine.wrap import unwrap, wrap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS, MICRO, RTOL = 4, 2, 1e-5


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _gpt() -> nn.Module:  # tied embedding and head
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _regression(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(6, 16, generator=gen), torch.randn(6, 4, generator=gen)


def _tokens(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randint(0, 32, (4, 16), generator=gen), torch.randint(0, 32, (4, 16), generator=gen)


def _images(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(6, 1, 8, 8, generator=gen), torch.randint(0, 10, (6,), generator=gen)


def _ce(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, target.flatten())


# name -> (model, batch, loss, EngineConfig options for both engines)
CASES: dict[str, tuple[Callable, Callable, Callable, dict]] = {
    "mlp_small_buckets": (_mlp, _regression, F.mse_loss, {"bucket_cap_mb": 0.005}),
    "gpt_tied": (_gpt, _tokens, _ce, {}),
    "convnet_batchnorm": (lambda: ConvNet(image_size=8), _images, _ce, {}),
    "gpt_bf16_autocast": (_gpt, _tokens, _ce, {"precision": "bf16"}),
}


def _train(model: nn.Module, batch: Callable, loss_fn: Callable, rank: int) -> dict:
    """STEPS steps of MICRO micro-batches; the losses, and parameters, gradients and buffers on the CPU."""
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        optimizer.zero_grad(set_to_none=True)
        for micro in range(MICRO):
            x, y = (t.to(device) for t in batch(gen))
            model.require_backward_grad_sync = micro == MICRO - 1  # what no_sync() toggles
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    module = unwrap(model)
    return {
        "losses": losses,
        "params": {n: p.detach().cpu() for n, p in module.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.cpu() for n, p in module.named_parameters()},
        "buffers": {n: b.cpu() for n, b in module.named_buffers()},
    }


def _both_engines_on_cuda_0(env) -> dict:
    # Before the first cuBLAS call: deterministic kernels where torch has them (warn elsewhere).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    assert env.backend == "gloo", env
    on_gpu = dataclasses.replace(env, device=torch.device("cuda", 0))  # both ranks on the one GPU
    torch.cuda.set_device(0)
    results = {}
    for name, (build, batch, loss_fn, options) in CASES.items():
        torch.manual_seed(0)
        base = build()
        results[name] = {}
        for engine in ("torch", "native"):
            model = wrap(copy.deepcopy(base), on_gpu, EngineConfig(engine=engine, **options))
            assert next(model.parameters()).device == on_gpu.device
            results[name][engine] = _train(model, batch, loss_fn, env.rank)
    return results


@pytest.fixture(scope="module")
def world_of_two() -> list[dict]:
    return run_ranks(_both_engines_on_cuda_0, 2, backend="gloo")


def _assert_close(reference: dict, ours: dict, what: str) -> None:
    assert ours["losses"] == pytest.approx(reference["losses"], rel=RTOL), f"{what}: losses"
    for kind in ("params", "grads", "buffers"):
        assert reference[kind].keys() == ours[kind].keys(), f"{what}: {kind}"
        for key, expected in reference[kind].items():
            got = ours[kind][key]
            assert (expected is None) == (got is None), f"{what}: {kind} {key}"
            if expected is None:
                continue
            scale = expected.abs().max().item() if expected.is_floating_point() else 0.0
            where = f"{what}: {kind} {key}"
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=RTOL * scale, msg=where)


@pytest.mark.parametrize("name", list(CASES))
def test_native_equals_torch_ddp_on_cuda_over_gloo(world_of_two: list[dict], name: str) -> None:
    for rank, result in enumerate(world_of_two):
        _assert_close(result[name]["torch"], result[name]["native"], f"rank {rank} {name}")


def test_the_two_ranks_hold_the_same_weights(world_of_two: list[dict]) -> None:
    # The gradients were really averaged across the two processes: the ranks saw different data.
    for name in CASES:
        first, second = (result[name]["native"] for result in world_of_two)
        assert first["losses"] != second["losses"], f"{name}: both ranks saw the same data"
        # Buffers are not compared: BatchNorm's running statistics differ by rank between the
        # broadcasts from rank 0 before each forward.
        _assert_close({**first, "buffers": {}, "losses": []}, {**second, "buffers": {}, "losses": []}, name)
