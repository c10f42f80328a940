"""Quiet by default: a 100-step run that checkpoints every 10 steps prints no line per checkpoint,
and one at its end that says how many and the last."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.logs import log_level, setup_logging


def test_checkpoints_are_one_line_at_the_end(tmp_path, capfd):
    run = ddpkit.Run(out=tmp_path / "run", global_batch=4, save_every=10, steps=100, progress=False)
    model = run.setup(nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.track(optimizer)
    for x, y in run.loader(TensorDataset(torch.randn(400, 3), torch.randn(400, 1))):
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()
    run.finish()
    err = capfd.readouterr().err.splitlines()
    assert not [line for line in err if "saved" in line], err
    said = [line for line in err if "checkpoint(s) written" in line]
    assert len(said) == 1 and "10 checkpoint(s) written, the last" in said[0] and "step-00000100" in said[0]


@pytest.mark.parametrize(
    ("level", "rank0", "others"),
    [
        (None, logging.INFO, logging.WARNING),
        ("debug", logging.DEBUG, logging.DEBUG),
        ("WARNING", logging.WARNING, logging.WARNING),
        ("error", logging.ERROR, logging.ERROR),
    ],
)
def test_one_setting_makes_ddpkit_quieter_or_louder(monkeypatch, level, rank0, others):
    if level is None:
        monkeypatch.delenv("DDPKIT_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("DDPKIT_LOG_LEVEL", level)
    logger = logging.getLogger("ddpkit")
    before = logger.level, list(logger.handlers), logger.propagate
    try:
        setup_logging(DistEnv(rank=0, world_size=2))
        assert logger.level == rank0
        setup_logging(DistEnv(rank=1, world_size=2))
        assert logger.level == others
    finally:
        logger.setLevel(before[0])
        logger.handlers[:], logger.propagate = before[1], before[2]


def test_an_unknown_log_level_is_one_line_with_the_choices():
    with pytest.raises(ConfigError, match=r"log level 'loud' is not one of debug, info, warning, error; "):
        log_level("loud")
