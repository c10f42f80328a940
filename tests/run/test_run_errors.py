"""A user's mistakes on ddpkit.Run end as one line naming the value and the fix, never a traceback;
a torch.compile'd model is saved and resumed under its own keys."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.checkpoint import list_checkpoints, load_checkpoint
from ddpkit.errors import ConfigError


class Net(nn.Module):
    """A frozen layer first and a weight tied between two layers: torch's DDP numbers neither
    twice, so naming its numbers takes its own order. ``head`` and ``tied.bias`` are never used."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.tied = nn.Linear(4, 4)
        self.tied.weight = self.body.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.frozen(x)).sum(1, keepdim=True)  # (B, 1)


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def _train(run: ddpkit.Run, model: nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    for x, y in run.loader(_data(8)):
        optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        optimizer.step()


@pytest.mark.parametrize("engine", ["torch", "native"])
def test_an_unused_parameter_is_one_line_naming_it_and_the_fix(engine):
    with ddpkit.Run(global_batch=4, progress=False, engine=engine) as run:
        with pytest.raises(ConfigError) as caught:
            _train(run, run.setup(Net()))
    message = str(caught.value)
    named = "3 parameter(s) of Net ('head.weight', 'head.bias', 'tied.bias')"  # in torch's numbering order
    assert message.startswith(f"{named} got no gradient in the last backward pass")
    assert "ddpkit.Run(find_unused_parameters=True)" in message and "requires_grad_(False)" in message
    assert "\n" not in message and isinstance(caught.value, RuntimeError)  # torch's DDP type stays
    with ddpkit.Run(global_batch=4, progress=False, engine=engine, find_unused_parameters=True) as run:
        _train(run, run.setup(Net()))  # the fix the line names


def _compiled(run: ddpkit.Run, order: str) -> tuple[nn.Module, nn.Module]:
    """(the model the loop calls, the plain model inside)."""
    plain = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    if order == "compile, then setup":
        return run.setup(torch.compile(plain, backend="eager")), plain
    return torch.compile(run.setup(plain), backend="eager"), plain


@pytest.mark.parametrize("order", ["compile, then setup", "setup, then compile"])
def test_a_compiled_model_is_saved_and_resumed_under_its_own_keys(tmp_path, order):
    try:
        with ddpkit.Run(out=tmp_path, global_batch=4, save_every=1, progress=False) as run:
            model, plain = _compiled(run, order)
            _train(run, model)
        keys = list(plain.state_dict())
        saved = torch.load(tmp_path / "model.pt", weights_only=True)
        assert list(saved) == keys == ["0.weight", "0.bias", "2.weight", "2.bias"]
        checkpoint = load_checkpoint(list_checkpoints(tmp_path / "checkpoints")[-1])
        assert list(checkpoint["state"]["model"]) == keys
        with ddpkit.Run(out=tmp_path, global_batch=4, progress=False) as run:  # resume="auto"
            model, plain = _compiled(run, order)
            for key, value in plain.state_dict().items():
                assert torch.equal(value, saved[key]), key
            _train(run, model)  # the next epoch, after the two steps it resumed from
            assert run.step == 4
    finally:
        torch._dynamo.reset()


SCRIPT = textwrap.dedent(
    """
    import sys, ddpkit
    if sys.argv[1] == "config":
        ddpkit.Run(global_bach=3)
    raise RuntimeError("a real bug")
    """
)


@pytest.mark.slow
def test_an_uncaught_config_error_in_a_plain_script_is_one_line_and_exit_code_2(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    config, bug = (
        subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True, timeout=120)
        for kind in ("config", "bug")
    )
    assert config.returncode == 2, config.stderr
    assert config.stderr.startswith("ddpkit: error: ddpkit.Run got unknown options ['global_bach']")
    assert len(config.stderr.splitlines()) == 1, config.stderr
    assert bug.returncode == 1 and "Traceback" in bug.stderr and "RuntimeError: a real bug" in bug.stderr


def test_workers_under_a_tmpdir_too_long_for_their_socket_are_one_line_not_a_hang(monkeypatch):
    # With TMPDIR 95 characters long, 2 workers died binding their socket ("AF_UNIX path too
    # long", in a feeder thread) and the loop waited for their first batch for ever.
    monkeypatch.setattr("tempfile.tempdir", "/tmp/" + "x" * 90)
    run = ddpkit.Run(global_batch=4, progress=False)
    data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    try:
        with pytest.raises(ConfigError, match=r"TMPDIR='/tmp/x+' is 95 characters.*at most 75 characters"):
            run.loader(data, num_workers=2)
        with pytest.raises(ConfigError, match="is 95 characters"):
            run.evaluate(data, lambda batch: batch[1].mean(), num_workers=1)
        assert len(list(run.loader(data, num_workers=0))) == 2  # no workers, no socket
    finally:
        run.finish()
