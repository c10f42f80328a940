"""A resumed run whose script now sets an optimizer's or scheduler's hyper-parameters otherwise
says so in one line (which, the checkpoint's value, the script's) and trains on with the
checkpoint's, for an exact resume; an lr the loop sets by hand each step is not a changed setting,
and a warm-up that set every rate to 0 before run.track hides no edited lr."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def _train(
    out, steps: int, lr: float, gamma: float = 0.5, by_hand: bool = False, warmup: bool = False
) -> float:
    """The lr the optimizer had at the first batch, after any resume."""
    run = ddpkit.Run(out=out, global_batch=4, save_every=2, steps=steps, progress=False)
    torch.manual_seed(0)
    model = run.setup(nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if warmup:  # diffusers' train_unconditional.py: its rates are 0 from here to run.track
        from diffusers.optimization import get_scheduler

        scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=8)
    else:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=gamma)
    run.track(optimizer, scheduler)
    first = None
    for x, y in run.loader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1))):
        first = optimizer.param_groups[0]["lr"] if first is None else first
        if by_hand:
            for group in optimizer.param_groups:
                group["lr"] = lr * (1 - run.step / 100)  # nanoGPT's habit
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
    run.finish()
    return first


def _said(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if "the script sets" in line]


def test_an_edited_lr_and_gamma_are_named_and_the_checkpoints_kept(tmp_path, capfd):
    _train(tmp_path / "run", steps=2, lr=0.1)
    assert _train(tmp_path / "run", steps=4, lr=0.05, gamma=0.25) == 0.1  # the checkpoint's rate trains on
    said = _said(capfd)
    assert len(said) == 1, said
    assert (
        "optimizer: lr 0.05 here, 0.1 saved" in said[0] and "scheduler: gamma 0.25 here, 0.5 saved" in said[0]
    )
    _train(tmp_path / "run", steps=6, lr=0.1)  # as the checkpoint: nothing to say
    assert _said(capfd) == []


def test_an_lr_set_by_hand_each_step_is_not_a_changed_setting(tmp_path, capfd):
    _train(tmp_path / "run", steps=2, lr=0.1, by_hand=True)
    _train(tmp_path / "run", steps=4, lr=0.1, by_hand=True)
    assert _said(capfd) == []


def test_an_edited_lr_under_a_warm_up_is_named_and_an_unedited_rerun_says_nothing(tmp_path, capfd):
    # The warm-up's first rate is 0 for any lr: the script's lr is the group's initial_lr.
    pytest.importorskip("diffusers")
    _train(tmp_path / "run", steps=2, lr=0.1, warmup=True)
    _train(tmp_path / "run", steps=4, lr=0.05, warmup=True)
    said = _said(capfd)
    assert len(said) == 1, said
    assert "the script sets optimizer: lr 0.05 here, 0.1 saved;" in said[0]
    assert "not compared, the script's own apply: scheduler's lr_lambdas (functions)" in said[0]
    _train(tmp_path / "run", steps=6, lr=0.1, warmup=True)  # as the checkpoint: nothing to say
    assert _said(capfd) == []
