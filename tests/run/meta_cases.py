"""Models built on the meta device and given their values at run.setup, on the torch and fsdp
engines: what tests/run/test_run_meta.py launches on 1, 2 and 3 processes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


class Net(nn.Module):
    """Layers that draw in module order, a LayerNorm, a buffer computed in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(x)))) * self.scale


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain keys, full tensors (a sharded parameter gathered), copied now."""
    module = getattr(model, "module", model)
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def train(engine: str, build: str, weights: str | None) -> dict:
    """The initial and final weights of 8 SGD steps; ``build``: eager, meta or empty."""
    run = ddpkit.Run(global_batch=12, engine=engine, progress=False)
    if build == "eager":
        net = Net()
    elif build == "empty":
        with ddpkit.empty_init():
            net = Net()
    else:
        with torch.device("meta"):
            net = Net()
    model = run.setup(net, weights=weights)
    first = full_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.track(optimizer)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=gen), torch.randn(48, 2, generator=gen))
    loader = run.loader(data)
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()
    last = full_state(model)  # gathered while the process group lives
    run.finish()
    return {"first": first, "last": last}


def every_case(weights: str) -> dict:
    cases = {("torch", "eager", "file"): train("torch", "eager", weights)}
    for engine in ("torch", "fsdp"):
        cases[engine, "empty", "file"] = train(engine, "empty", weights)
        cases[engine, "empty", "init"] = train(engine, "empty", None)
    cases["torch", "eager", "init"] = train("torch", "eager", None)
    return cases
