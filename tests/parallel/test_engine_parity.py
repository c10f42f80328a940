"""ddpkit.DataParallel against torch's DistributedDataParallel: same steps, same data, same result.

Each rank builds one model, deep-copies it for each engine, and trains both on the same batches
(different on each rank). At world size 2 every parameter, gradient and buffer must be equal bit
for bit: both engines scale by 1/2 before a two-term sum, which is exact. At world size 4 gloo's
summation order depends on the bucket layout, so a tolerance applies.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit import DataParallel
from ddpkit.models import GPT, ConvNet, GPTConfig, ToyModel

pytestmark = pytest.mark.slow  # each file spawns its ranks once, for a few seconds


class Branchy(nn.Module):
    """A trunk and head, a branch no rank ever uses, and one that only some ranks use some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)
        self.sometimes = nn.Linear(16, 4)

    def forward(self, x: Tensor, use_sometimes: bool) -> Tensor:
        h = F.relu(self.trunk(x))  # (B, 16)
        out = self.head(h)
        return out + self.sometimes(h) if use_sometimes else out


class ToyMpModel(nn.Module):
    """The seeds' DDP-with-model-parallel demo: two halves on two devices (both cpu here)."""

    def __init__(self, dev0: str = "cpu", dev1: str = "cpu") -> None:
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.net1 = nn.Linear(10, 10).to(dev0)
        self.net2 = nn.Linear(10, 5).to(dev1)

    def forward(self, x: Tensor) -> Tensor:
        return self.net2(F.relu(self.net1(x.to(self.dev0))).to(self.dev1))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _frozen() -> nn.Module:
    model = _mlp()
    for p in model[2].parameters():  # a frozen layer in the middle
        p.requires_grad_(False)
    return model


def _gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _regression(gen: torch.Generator, step: int, rank: int) -> tuple[tuple, Tensor]:
    return (torch.randn(6, 16, generator=gen),), torch.randn(6, 4, generator=gen)


def _tokens(gen: torch.Generator, step: int, rank: int) -> tuple[tuple, Tensor]:
    x = torch.randint(0, 32, (4, 16), generator=gen)
    return (x,), torch.randint(0, 32, (4, 16), generator=gen)


def _images(gen: torch.Generator, step: int, rank: int) -> tuple[tuple, Tensor]:
    return (torch.randn(6, 1, 8, 8, generator=gen),), torch.randint(0, 10, (6,), generator=gen)


def _branchy_batch(gen: torch.Generator, step: int, rank: int) -> tuple[tuple, Tensor]:
    # step % 3: 0 -> only rank 1 uses `sometimes`, 1 -> every rank, 2 -> none (globally unused)
    use = (step % 3 == 0 and rank == 1) or step % 3 == 1
    return (torch.randn(6, 8, generator=gen), use), torch.randn(6, 4, generator=gen)


def _toy_batch(gen: torch.Generator, step: int, rank: int) -> tuple[tuple, Tensor]:
    return (torch.randn(6, 10, generator=gen),), torch.randn(6, 5, generator=gen)


def _ce(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, target.flatten())


@dataclass(frozen=True)
class Case:
    """One parity scenario: a model, its data and loss, and how both engines are configured."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int, int], tuple[tuple, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor] = F.mse_loss
    kwargs: dict = field(default_factory=dict)  # passed to both engines
    micro_batches: int = 1  # all but the last run inside no_sync()
    set_to_none: bool = True
    steps: int = 4
    sgd: bool = False  # plain SGD instead of AdamW, which blows rounding noise up to lr-sized steps


CASES = {
    "mlp": Case(_mlp, _regression, kwargs={"bucket_cap_mb": 0.002}),  # several buckets
    "convnet_batchnorm": Case(lambda: ConvNet(image_size=8), _images, _ce),
    "gpt_tied": Case(_gpt, _tokens, _ce),
    "unused_branch": Case(
        Branchy, _branchy_batch, kwargs={"find_unused_parameters": True}, set_to_none=False
    ),
    "no_sync_4_micro": Case(_mlp, _regression, micro_batches=4, set_to_none=False),
    "frozen": Case(_frozen, _regression),
    "model_parallel": Case(ToyMpModel, _toy_batch),
    "no_sync_set_to_none": Case(ToyModel, _toy_batch, micro_batches=2),
}
WORLD_OF_FOUR = {"gpt_tied_sgd": Case(_gpt, _tokens, _ce, sgd=True)}


def train(engine: nn.Module, case: Case, rank: int) -> dict[str, dict[str, Tensor | None]]:
    """Train ``case.steps`` steps; return parameters, gradients and buffers."""
    params = [p for p in engine.parameters() if p.requires_grad]
    optimizer = (
        torch.optim.SGD(params, lr=0.1, momentum=0.9) if case.sgd else torch.optim.AdamW(params, lr=1e-2)
    )
    for step in range(case.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        optimizer.zero_grad(set_to_none=case.set_to_none)
        for micro in range(case.micro_batches):
            inputs, target = case.batch(gen, step, rank)
            if micro < case.micro_batches - 1:
                with engine.no_sync():
                    case.loss(engine(*inputs), target).backward()
            else:
                case.loss(engine(*inputs), target).backward()
        optimizer.step()
    module = engine.module
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()},
        "buffers": {n: b.clone() for n, b in module.named_buffers()},
    }


def _both_engines(env, names: list[str]) -> dict[str, tuple[dict, dict]]:
    results = {}
    for name in names:
        case = CASES.get(name) or WORLD_OF_FOUR[name]
        torch.manual_seed(0)
        model = case.build()
        reference = DistributedDataParallel(copy.deepcopy(model), **case.kwargs)
        ours = DataParallel(copy.deepcopy(model), **case.kwargs)
        results[name] = (train(reference, case, env.rank), train(ours, case, env.rank))
    return results


def assert_same(reference: dict, ours: dict, rtol: float = 0.0) -> None:
    """Equal bit for bit (rtol 0), or each tensor within rtol of the reference relative to its
    largest element (so entries that are numerically zero, like attention's key bias gradient,
    are not held to a relative bound); None only where None."""
    for kind in ("params", "grads", "buffers"):
        assert reference[kind].keys() == ours[kind].keys()
        for name, expected in reference[kind].items():
            got = ours[kind][name]
            assert (expected is None) == (got is None), f"{kind} {name}: {expected} vs {got}"
            if expected is None:
                continue
            if rtol == 0.0:
                assert torch.equal(expected, got), f"{kind} {name} differs by {(expected - got).abs().max()}"
            else:
                scale = expected.abs().max().item()
                torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol * scale, msg=f"{kind} {name}")


@pytest.fixture(scope="module")
def world_of_two() -> list[dict]:
    # One spawn for every case: starting processes costs far more than these tiny models.
    return run_ranks(_both_engines, 2, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_bit_exact_with_torch_ddp_at_world_size_2(world_of_two: list[dict], name: str) -> None:
    for rank_result in world_of_two:
        reference, ours = rank_result[name]
        assert_same(reference, ours)


def test_ranks_agree_after_training(world_of_two: list[dict]) -> None:
    for name in CASES:
        first, second = world_of_two[0][name][1], world_of_two[1][name][1]
        # Buffers are not compared: BatchNorm statistics drift apart in each forward and are
        # re-synchronized from rank 0 before the next one.
        assert_same({**first, "buffers": {}}, {**second, "buffers": {}})


def test_unused_branch_leaves_globally_unused_grad_alone(world_of_two: list[dict]) -> None:
    reference, ours = world_of_two[0]["unused_branch"]
    assert ours["grads"]["never.weight"] is None
    # Last step (3 % 3 == 0): only rank 1 used `sometimes`; rank 0 still gets the average.
    assert ours["grads"]["sometimes.weight"].abs().sum() > 0


def test_world_size_4_within_tolerance() -> None:
    for result in run_ranks(_both_engines, 4, list(WORLD_OF_FOUR)):
        reference, ours = result["gpt_tied_sgd"]
        # Four-term sums are ordered by gloo's chunking of each bucket, and the engines lay out
        # their first-step buckets differently (torch: one bucket in registration order); the
        # rest is the same arithmetic, so only the last bits may differ.
        assert_same(reference, ours, rtol=1e-6)
