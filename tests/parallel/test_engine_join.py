"""Uneven inputs: with ``join()``, ranks that run out of batches shadow the others instead of hanging,
and the result equals torch DDP's ``join()`` on the same uneven data bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit import DataParallel
from ddpkit.models import ConvNet

pytestmark = pytest.mark.slow  # each file spawns its ranks once, for a few seconds


class Gated(nn.Module):
    """A trunk and a branch the loss only reaches when ``gate`` is set (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, gate: bool) -> torch.Tensor:
        h = self.trunk(x)  # (B, 8)
        return self.branch(h) if gate else h


SCENARIOS = {
    # name: (model builder, batch builder, loss, DataParallel/DDP kwargs, batches per rank)
    "convnet": (lambda: ConvNet(image_size=8), "images", F.cross_entropy, {}, (1, 4)),
    "find_unused": (Gated, "gated", F.mse_loss, {"find_unused_parameters": True}, (4, 2)),
}


def _batch(kind: str, gen: torch.Generator, step: int) -> tuple[tuple, torch.Tensor]:
    if kind == "images":
        return (torch.randn(4, 1, 8, 8, generator=gen),), torch.randint(0, 10, (4,), generator=gen)
    # The branch is unused by every rank at step 1 (before anyone joins) and used afterwards.
    return (torch.randn(4, 8, generator=gen), step != 1), torch.randn(4, 8, generator=gen)


def _train_uneven(engine: nn.Module, scenario: str, rank: int) -> dict:
    _, kind, loss_fn, _, counts = SCENARIOS[scenario]
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    with engine.join():
        for step in range(counts[rank]):
            inputs, target = _batch(kind, torch.Generator().manual_seed(10 * step + rank), step)
            optimizer.zero_grad()
            loss_fn(engine(*inputs), target).backward()
            optimizer.step()
    # Both engines must still be usable together afterwards (no stray join all-reduces).
    torch.distributed.barrier()
    module = engine.module
    return {n: t.detach().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}


def _branch_grad_when_alone_and_unused(rank: int) -> torch.Tensor | None:
    """Rank 1 joins at once; rank 0 then runs one step that leaves the branch unused."""
    torch.manual_seed(0)
    engine = DataParallel(Gated(), find_unused_parameters=True)
    with engine.join():
        for _ in range(1 - rank):
            engine(torch.randn(4, 8), False).sum().backward()
    return engine.module.branch.weight.grad


def _both(env, scenarios: list[str]) -> dict:
    out = {"alone": _branch_grad_when_alone_and_unused(env.rank)}
    for name in scenarios:
        build, _, _, kwargs, _ = SCENARIOS[name]
        torch.manual_seed(0)
        model = build()
        out[name] = [
            _train_uneven(engine(copy.deepcopy(model), **kwargs), name, env.rank)
            for engine in (DistributedDataParallel, DataParallel)
        ]
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_both, 2, list(SCENARIOS))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_uneven_inputs_match_torch_join(results, scenario: str) -> None:
    for rank_result in results:
        reference, ours = rank_result[scenario]
        for name, expected in reference.items():
            assert torch.equal(expected, ours[name]), f"{scenario}: {name} differs from torch DDP's join"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ranks_leave_join_with_the_same_model(results, scenario: str) -> None:
    first, second = (r[scenario][1] for r in results)
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), f"{scenario}: {name} differs between ranks"


def test_joined_ranks_use_no_parameter(results) -> None:
    # Nobody used the branch, so it gets no gradient. (torch DDP's joined ranks re-send the
    # previous step's all-reduced used-map, so torch would hand rank 0 a zero gradient here.)
    assert results[0]["alone"] is None
