"""``run.save_best``: OUT/best.pt holds the weights of the best value so far, apart from the
checkpoints' rotation, and the best value is checkpointed: a resumed run never overwrites a better
model with a worse one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import ConfigError


def _train(out, epochs: int, values: dict[int, float]) -> dict[int, dict]:
    """Each epoch's end weights; ``values[epoch]`` is offered as that epoch's validation loss."""
    run = ddpkit.Run(out=out, global_batch=4, save_every=4, keep_last=1, steps=4 * epochs, progress=False)
    torch.manual_seed(0)
    model = run.setup(nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    loader = run.loader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)))
    weights = {}
    for epoch in range(loader.epoch, epochs):
        for x, y in loader:
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()
        run.save_best(values[epoch])
        weights[epoch] = {k: v.clone() for k, v in model.module.state_dict().items()}
    run.finish()
    return weights


def test_the_best_weights_survive_rotation_and_a_resume_with_a_worse_value(tmp_path):
    out = tmp_path / "run"
    weights = _train(out, 3, {0: 3.0, 1: 1.0, 2: 2.0})
    best = torch.load(out / "best.pt", weights_only=True)
    assert all(torch.equal(best[k], v) for k, v in weights[1].items())  # epoch 1's, not the last
    assert not (out / "checkpoints" / "step-00000008").exists()  # keep_last=1 rotated it out
    written = (out / "best.pt").read_bytes()
    _train(out, 4, {3: 2.5})  # resumed: 2.5 beats nothing the checkpoint remembers
    assert (out / "best.pt").read_bytes() == written
    _train(out, 5, {4: 0.5})
    assert (out / "best.pt").read_bytes() != written


def test_save_best_needs_an_out_and_one_mode(tmp_path):
    run = ddpkit.Run(out=tmp_path / "run", progress=False)
    try:
        run.setup(nn.Linear(2, 1))
        assert run.save_best(1.0, mode="max")
        with pytest.raises(ConfigError, match=r"kept with mode='max'; keep one mode"):
            run.save_best(0.5)
        with pytest.raises(ConfigError, match=r"run.save_best\('low'\): give the validation value"):
            run.save_best("low", mode="max")
    finally:
        run.close()
