"""Misuses of the front door a new user makes, each one line at the call naming the argument and
the fix, with nothing written to ``out`` (issue 36's six that used to end in a traceback)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import ConfigError


def _one_line(caught: pytest.ExceptionInfo, *words: str) -> None:
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_an_out_that_cannot_be_a_folder_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("mine", encoding="utf-8")
    for out, words in [
        (tmp_path / "a_file", ("out=", "a_file", "File exists", "choose a folder")),
        (tmp_path / "a_file" / "run", ("out=", "Not a directory", "choose a folder")),
    ]:
        with pytest.raises(ConfigError) as caught:
            ddpkit.Run(out=out, progress=False)
        _one_line(caught, *words)
    assert (tmp_path / "a_file").read_text(encoding="utf-8") == "mine"  # nothing of the user's is touched


def test_calls_with_the_wrong_kind_of_value_are_one_line_at_the_call(tmp_path):
    run = ddpkit.Run(out=tmp_path / "run", global_batch=4, progress=False)
    try:
        with pytest.raises(ConfigError) as caught:
            run.setup("model")
        _one_line(caught, "run.setup takes an nn.Module, got str")
        model = run.setup(nn.Linear(2, 1))
        data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
        with pytest.raises(ConfigError) as caught:
            run.evaluate(data, lambda batch: "low")
        _one_line(caught, "run.evaluate: fn returned value='low'", "one-element tensor")
        # loss.item(), a number, is taken as the batch's mean
        mean = run.evaluate(data, lambda batch: nn.functional.mse_loss(model(batch[0]), batch[1]).item())
        assert mean["samples"] == 8
        for x, y in run.loader(data):
            loss = nn.functional.mse_loss(model(x), y)
            with pytest.raises(ConfigError) as caught:
                run.log(note="abc")
            _one_line(caught, "run.log(note='abc')", "run.print")
            with pytest.raises(ConfigError) as caught:
                run.backward(loss.detach())
            _one_line(caught, "run.backward got a loss with no gradient")
            break
    finally:
        run.close()
    assert not (tmp_path / "run" / "checkpoints").exists()
