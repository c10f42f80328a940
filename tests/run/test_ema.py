"""ddpkit.EMA on a plain model, against torch's AveragedModel with its EMA averaging function
(the sharded EMA is in tests/run/test_run_fsdp.py, which runs it on 1/2/3 processes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers.training_utils import EMAModel
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

import ddpkit


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _data() -> TensorDataset:
    """16 samples: 2 steps of 8 an epoch."""
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))


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


# --- a decay warm-up, and the averages of other libraries ------------------------------------------


@pytest.mark.parametrize("after", [0, 3])
def test_ema_warmup_is_the_inverse_gamma_form_of_diffusers_and_timm(after):
    warmup = ddpkit.ema_warmup(
        inv_gamma=2.0, power=0.75, min_decay=0.3, max_decay=0.99, update_after_step=after
    )
    for step in range(1, 2000):  # 1 - (1 + s / 2) ** -0.75 is 0.26 at s = 1 and 0.99 from s = 926
        s = step - after - 1
        by_hand = 0.0 if s <= 0 else min(max(1 - (1 + s / 2.0) ** -0.75, 0.3), 0.99)
        assert warmup(step) == by_hand, step
    assert warmup(after + 1) == 0.0 and warmup(after + 2) == 0.3  # min_decay binds from s = 1 on
    assert ddpkit.ema_warmup(power=2 / 3)(31624) > 0.999 > ddpkit.ema_warmup(power=2 / 3)(31620)
    # diffusers' own schedule, to the bit
    ours = ddpkit.ema_warmup(power=0.75, max_decay=0.999, update_after_step=after)
    theirs = EMAModel([nn.Parameter(torch.zeros(1))], decay=0.999, use_ema_warmup=True, power=0.75)
    theirs.update_after_step = after
    assert all(ours(step) == theirs.get_decay(step) for step in range(0, 50000, 7))


@pytest.mark.parametrize(
    "bad",
    [
        {"inv_gamma": 0},
        {"power": -1},
        {"max_decay": 1.0},
        {"min_decay": 0.5, "max_decay": 0.4},
        {"update_after_step": 1.5},
    ],
)
def test_a_bad_warmup_is_one_line(bad):
    with pytest.raises(ddpkit.ConfigError, match=r"^ddpkit.ema_warmup\(.*\): (give|both)[^\n]*$"):
        ddpkit.ema_warmup(**bad)


def test_a_decay_function_reads_the_runs_step_once_per_optimizer_step():
    # Under micro_batch (2 micro-batches a step), update() after every micro-batch: the function
    # sees each optimizer step once, from the second (the first update copies), and the average
    # is the lerp of each step's weights by 1 - decay(step), computed here by hand.
    seen: list[int] = []

    def decay(step: int) -> float:
        return 1 - 1 / (step + 1)

    run = ddpkit.Run(global_batch=8, micro_batch=4, shuffle=False, progress=False)
    model = run.setup(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = ddpkit.EMA(model, decay=lambda step: seen.append(step) or decay(step))
    run.track(optimizer, ema=ema)
    loader, net, by_hand = run.loader(_data()), ddpkit.unwrap(model), None
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()
            ema.update()
            if run.at_step_end:
                weights = {k: v.detach() for k, v in net.named_parameters()}
                if by_hand is None:
                    by_hand = {k: v.clone() for k, v in weights.items()}
                else:
                    by_hand = {
                        k: torch.lerp(v, weights[k], 1.0 - decay(run.step)) for k, v in by_hand.items()
                    }
    run.finish()
    assert seen == [2, 3, 4] and ema.updates == 4
    assert all(torch.equal(ema.shadow[k], v) for k, v in by_hand.items())


def test_a_decay_function_out_of_range_is_one_line():
    run, model, ema = _tracked(_net(), 0.5)
    ema.decay = lambda step: 1.5
    ema.update()
    with pytest.raises(ddpkit.ConfigError, match=r"decay function gave 1.5 at step 0; it must give"):
        ema.update()
    run.close()


class TimmStyleEma(nn.Module):
    """timm's ModelEmaV3 as its public API reads (timm needs torchvision, which is not installable
    here): a deep copy as ``.module``, ``update(model, step)`` with its decay from the step."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        self.module, self.decay = copy.deepcopy(model).eval(), decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        decay = 0.0 if step <= 1 else self.decay  # timm's get_decay without warm-up
        for ema_v, model_v in zip(
            self.module.state_dict().values(), model.state_dict().values(), strict=True
        ):
            ema_v.lerp_(model_v, 1.0 - decay)


def _ema_of(kind: str, run: ddpkit.Run, model: nn.Module) -> tuple[object, object]:
    """An EMA of ``kind`` tracked as ``ema``, and its update as porting.md writes it for the loop
    (``kind_every``: the update on every micro-batch, without ``run.at_step_end``)."""
    net = ddpkit.unwrap(model)
    if kind.endswith("_every"):
        ema, _ = _ema_of(kind.removesuffix("_every"), run, model)
        if isinstance(ema, EMAModel):
            return ema, lambda: ema.step(model.parameters())
        return ema, lambda: ema.update(net, step=run.step)
    if kind == "ddpkit":  # gated by the run: after every optimizer.step()
        ema = ddpkit.EMA(model, decay=ddpkit.ema_warmup(power=0.75, max_decay=0.99))
        update = ema.update
    elif kind == "diffusers":  # its own warm-up, in float64 for the dtype check below
        ema = EMAModel(model.parameters(), decay=0.99, use_ema_warmup=True, power=0.75)
        ema.to(dtype=torch.float64)
        update = lambda: run.at_step_end and ema.step(model.parameters())  # noqa: E731
    elif kind == "torch":  # AveragedModel: gated by the run
        ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        update = lambda: ema.update_parameters(net)  # noqa: E731
    else:
        ema = TimmStyleEma(net, decay=0.9)
        update = lambda: run.at_step_end and ema.update(net, step=run.step)  # noqa: E731
    run.track(ema=ema)
    return ema, update


def _loop(out, kind: str, crash_after: int | None = None) -> dict | None:
    """Two epochs of 2 steps of 2 micro-batches with an EMA of ``kind``, a checkpoint every 2
    steps; a KeyboardInterrupt after step ``crash_after`` stands for a kill. The EMA's state."""
    run = ddpkit.Run(out=out, global_batch=8, micro_batch=4, save_every=2, progress=False)
    model = run.setup(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    ema, update = _ema_of(kind, run, model)
    loader = run.loader(_data())
    try:
        for _ in range(loader.epoch, 2):
            for x, y in loader:
                optimizer.zero_grad()
                run.backward(F.mse_loss(model(x), y))
                optimizer.step()
                update()
                if run.at_step_end and run.step == crash_after:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        run.close()
        return None
    run.finish()
    return copy.deepcopy(ema.state_dict())


def _same(a: object, b: object) -> bool:
    """Equal to the bit, tensors in dtype and device too."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("kind", ["ddpkit", "diffusers", "torch", "timm"])
def test_an_ema_killed_and_resumed_is_the_uninterrupted_runs_to_the_bit(tmp_path, kind, capfd):
    whole = _loop(tmp_path / "whole", kind)
    assert _loop(tmp_path / "cut", kind, crash_after=3) is None  # the checkpoint of step 2 stays
    resumed = _loop(tmp_path / "cut", kind)
    assert "step-00000002 at step 2" in capfd.readouterr().out
    assert _same(resumed, whole)
    if kind == "diffusers":  # once per optimizer step, its warm-up at the run's step
        assert whole["optimization_step"] == 4 and whole["shadow_params"][0].dtype == torch.float64
    # OUT/ema.pt: the model's state dict with the averaged weights; model.pt the model's own
    averaged = torch.load(tmp_path / "cut" / "ema.pt", weights_only=True)
    if kind == "ddpkit":
        expected = whole["shadow"]
    elif kind == "diffusers":
        expected = dict(
            zip(["0.weight", "0.bias", "2.weight", "2.bias"], whole["shadow_params"], strict=True)
        )
    else:
        expected = {k.removeprefix("module."): v for k, v in whole.items() if k.startswith("module.")}
    assert averaged.keys() == torch.load(tmp_path / "cut" / "model.pt", weights_only=True).keys()
    assert all(torch.equal(averaged[k], v.float()) for k, v in expected.items())
    assert not torch.equal(averaged["0.weight"], torch.load(tmp_path / "cut" / "model.pt")["0.weight"])


@pytest.mark.parametrize("kind", ["diffusers", "timm"])
def test_a_library_ema_updated_on_every_micro_batch_still_averages_once_a_step(tmp_path, kind):
    # The run gates EMAModel.step and ModelEma.update as it gates an optimizer: a loop that forgot
    # run.at_step_end gets the same average (and warm-up count), not one per micro-batch.
    assert _same(_loop(tmp_path / "gated", kind), _loop(tmp_path / "every", kind + "_every"))
