"""ddpkit.EMA on a plain model, against torch's AveragedModel with its EMA averaging function
(the sharded EMA is in tests/run/test_run_fsdp.py, which runs it on 1/2/3 processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import ddpkit


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _tracked(net: nn.Module, decay: float) -> tuple[ddpkit.Run, nn.Module, ddpkit.EMA]:
    """A world-of-one run with ``net`` set up and an EMA of it tracked."""
    run = ddpkit.Run(progress=False)
    model = run.setup(net)
    ema = ddpkit.EMA(model, decay=decay)
    run.track(ema=ema)
    return run, model, ema


def test_the_average_is_averaged_models_to_the_bit():
    run, net, ours = _tracked(_net(), 0.9)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    theirs = AveragedModel(ddpkit.unwrap(net), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for step in range(6):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        F.mse_loss(net(x), x[:, :1]).backward()
        optimizer.step()
        ours.update()
        theirs.update_parameters(ddpkit.unwrap(net))
    for name, value in theirs.module.named_parameters():
        assert torch.equal(ours.state_dict()["shadow"][name], value), name
    run.close()


def test_an_untracked_ema_is_one_line_at_its_first_update():
    ema = ddpkit.EMA(_net())
    with pytest.raises(
        ddpkit.ConfigError, match=r"update\(\) before run.track\(ema=ema\): tracked, the average"
    ):
        ema.update()


def test_applied_swaps_the_average_in_and_puts_the_weights_back_exactly():
    run, model, ema = _tracked(_net(), 0.5)
    net = ddpkit.unwrap(model)
    ema.update()
    with torch.no_grad():
        net[0].weight.add_(1.0)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with ema.applied() as module:
        assert module is net
        assert torch.equal(net[0].weight, ema.shadow["0.weight"])
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    run.close()


def test_a_checkpointed_average_comes_back():
    ema = ddpkit.EMA(_net(), decay=0.5)
    saved = {"decay": 0.5, "updates": 1, "shadow": {k: v.clone() + 1 for k, v in ema.shadow.items()}}
    other = ddpkit.EMA(_net(), decay=0.5)
    other.load_state_dict(saved)
    assert other.updates == 1 and all(torch.equal(other.shadow[k], v) for k, v in saved["shadow"].items())
    with pytest.raises(ddpkit.ConfigError, match="averages other parameters"):
        ddpkit.EMA(nn.Linear(4, 1)).load_state_dict(saved)


@pytest.mark.parametrize("decay", [1.0, -0.1, "0.9", True])
def test_a_decay_outside_0_to_1_is_one_line(decay):
    with pytest.raises(ddpkit.ConfigError, match=r"ddpkit.EMA\(decay=.*\): give a number in \[0, 1\)"):
        ddpkit.EMA(_net(), decay=decay)


def test_averaged_model_of_a_sharded_model_is_one_line_naming_ddpkit_ema(tmp_path):
    run = ddpkit.Run(out=tmp_path / "run", engine="fsdp", global_batch=4, progress=False)
    try:
        model = run.setup(_net())
        with pytest.raises(
            ddpkit.ConfigError, match=r"a sharded Sequential cannot be deep-copied .*ddpkit.EMA"
        ):
            AveragedModel(model)
    finally:
        run.close()
