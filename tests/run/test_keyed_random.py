"""The per-sample keyed draws (run/invariant/keyed.py, draws.py, dropout.py): the hash is what it
says, its masks have dropout's statistics, and a sample's draws do not depend on which
micro-batch holds it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.launch.start_method import FORKSERVER
from ddpkit.run.invariant import keyed
from ddpkit.run.invariant.draws import SampleDraws
from ddpkit.run.invariant.dropout import key_dropout
from ddpkit.run.micro import Micro

CPU = torch.device("cpu")


def _micro(rows: int, offset: int = 0) -> Micro:
    return Micro(list(range(rows)), 1.0, rows, True, True, rows, offset)


def _draws(step: int = 1, rows: int = 8, offset: int = 0, seed: int = 0) -> SampleDraws:
    draws = SampleDraws(seed, CPU, eager=True)
    draws.enter(step, _micro(rows, offset))
    return draws


def test_the_torch_hash_equals_the_same_hash_in_exact_integers():
    x = torch.randint(
        -(2**31), 2**31 - 1, (4096,), dtype=torch.int32, generator=torch.Generator().manual_seed(0)
    )
    expected = [keyed.mix_int(int(v) & 0xFFFFFFFF) for v in x]
    assert keyed.mix(x).tolist() == [e - 2**32 if e >= 2**31 else e for e in expected]


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_a_million_elements_keep_one_minus_p_within_half_a_percent(p):
    mask = keyed.keep_mask(keyed.bits(_draws(rows=1000).keys, 1000, 7, keyed.Positions()), p)
    kept = mask.double().mean().item()
    assert abs(kept - (1 - p)) <= 0.005 * (1 - p), kept


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def test_masks_of_other_samples_steps_modules_and_positions_are_uncorrelated():
    positions = keyed.Positions()

    def mask(step: int, stream: int, rows: int = 1001, offset: int = 0) -> torch.Tensor:
        keys = _draws(step=step, rows=rows, offset=offset).keys
        return keyed.keep_mask(keyed.bits(keys, 1000, stream, positions), 0.5)  # (rows, 1000)

    base = mask(1, 3)
    pairs = {
        "samples": (base[:-1], base[1:]),
        "positions": (base[:, :-1], base[:, 1:]),
        "steps": (base, mask(2, 3)),
        "modules": (base, mask(1, 4)),
    }
    for what, (a, b) in pairs.items():
        assert abs(_corr(a, b)) < 1e-2, what
    assert torch.equal(mask(1, 3, rows=1, offset=500)[0], base[500])  # the same sample, alone: the same


def test_normal_and_uniform_draws_have_their_moments():
    x = torch.empty(1000, 1000)
    draws = _draws(rows=1000)
    normal, uniform = draws.randn_like(x), draws.rand_like(x)
    assert abs(normal.mean().item()) < 5e-3 and abs(normal.std().item() - 1) < 5e-3
    assert 0 <= uniform.min().item() and uniform.max().item() < 1 and abs(uniform.mean().item() - 0.5) < 2e-3
    ints = draws.randint(0, 10, x)
    assert ints.shape == (1000,) and set(ints.tolist()) == set(range(10))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop, self.channels = nn.Dropout(0.3), nn.Dropout2d(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        return self.channels(self.drop(x))


def test_a_samples_masks_do_not_depend_on_the_micro_batch_that_holds_it():
    net, x = _Net(), torch.ones(6, 4, 3, 3)
    draws = SampleDraws(0, CPU, eager=True)
    key_dropout(net, draws, 0)
    draws.enter(5, _micro(6))
    whole = net(x)
    draws.enter(5, _micro(2, offset=4))  # samples 4 and 5 in a micro-batch of their own
    assert torch.equal(net(x[4:]), whole[4:])
    assert (whole == 0).float().mean() > 0.3  # both layers dropped something
    dropped = (net.channels(x) == 0).flatten(2)  # Dropout2d: a channel is dropped whole, or kept
    assert torch.equal(dropped.all(2) | ~dropped.any(2), torch.ones(6, 4, dtype=torch.bool))
    assert dropped.any()
    net.eval()
    assert torch.equal(net(x), x)


def test_flattened_and_sequence_first_inputs_get_the_samples_masks():
    draws = SampleDraws(0, CPU, eager=True)
    flat, seq_first = nn.Dropout(0.5), nn.Dropout(0.5)
    key_dropout(flat, draws, 0)
    key_dropout(seq_first, draws, 1)
    draws.enter(2, _micro(3))
    batch_first = flat(torch.ones(3, 5, 4))  # (B, T, C)
    draws.enter(2, _micro(3))
    assert torch.equal(flat(torch.ones(15, 4)), batch_first.reshape(15, 4))  # (B*T, C)
    draws.enter(2, _micro(3))
    assert torch.equal(seq_first(torch.ones(5, 3, 4)), batch_first.transpose(0, 1))  # (T, B, C)


def test_what_cannot_be_keyed_is_one_line():
    draws = SampleDraws(0, CPU, eager=True)
    with pytest.raises(ConfigError, match="AlphaDropout, which it cannot key"):
        key_dropout(nn.Sequential(nn.AlphaDropout(0.1)), draws, 0)
    drop = nn.Dropout(0.5)
    key_dropout(drop, draws, 0)
    draws.enter(1, _micro(4))
    with pytest.raises(ConfigError, match="does not hold the micro-batch's 4 samples"):
        drop(torch.ones(3, 2))
    with pytest.raises(ConfigError, match="first dimension must hold the micro-batch's 4 samples"):
        draws.randn_like(torch.ones(3))
    draws.leave()
    assert drop(torch.ones(3, 2)).shape == (3, 2)  # outside a step: nn.Dropout's own draws
    with pytest.raises(ConfigError, match="outside one use torch.rand_like"):
        draws.rand_like(torch.ones(4))


def _compiled_losses(compiled: bool) -> list[float]:
    run = ddpkit.Run(global_batch=8, micro_batch=4, invariant_dropout=True, progress=False, seed=1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1))
    model = run.setup(net)
    model = torch.compile(model) if compiled else model  # inductor, on the CPU
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    data = torch.utils.data.TensorDataset(torch.randn(24, 6), torch.randn(24, 1))
    losses = []
    for x, y in run.loader(data):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        run.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    run.finish()
    return losses


def _both() -> tuple[list[float], list[float]]:
    return _compiled_losses(False), _compiled_losses(True)


@pytest.mark.slow
def test_keyed_dropout_compiled_by_inductor_gives_eager_losses():
    # In a process of its own: inductor leaves compile workers and environment variables behind.
    eager, compiled = ddpkit.launch(_both, 1, start_method=FORKSERVER)[0]
    assert len(eager) == 6
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (eager, compiled)
