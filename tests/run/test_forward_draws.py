"""Functional dropout keyed per sample (run/invariant/functional_dropout.py) and what rank 0 says after the
first micro-batch (run/step/first_step.py), in a world of one: the same sample gets the same masks in
a micro-batch of 8 or of 2, and each habit that breaks the same update is said once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.run.invariant.draws import SampleDraws
from ddpkit.run.invariant.functional_dropout import ForwardDraws, keyed_attention
from ddpkit.run.micro import Micro


def _draws(offset: int, rows: int) -> SampleDraws:
    draws = SampleDraws(seed=3, device=torch.device("cpu"), eager=True)
    draws.enter(1, Micro(list(range(offset, offset + rows)), 1.0, rows, True, True, 0, offset))
    return draws


@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True},
        {"attn_mask": torch.rand(5, 7) > 0.3},
        {"attn_mask": torch.randn(4, 1, 5, 7)},
        {"scale": 0.3},
    ],
)
def test_keyed_attention_without_dropout_is_torchs_attention(options):
    q, k, v = torch.randn(4, 2, 5, 8), torch.randn(4, 2, 7, 8), torch.randn(4, 2, 7, 8)
    if options.get("is_causal"):
        k, v = k[:, :, :5], v[:, :, :5]
    ours = keyed_attention(_draws(0, 4), q, k, v, dropout_p=0.0, **options)
    torchs = F.scaled_dot_product_attention(q, k, v, **options)
    assert torch.allclose(ours, torchs, atol=1e-6)


def test_keyed_attention_with_grouped_query_heads_is_torchs():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    ours = keyed_attention(_draws(0, 2), q, k, v, enable_gqa=True)
    assert torch.allclose(ours, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-6)


class FunctionalNet(nn.Module):
    """Dropout written as functions, as transformers' attention writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 5, 8)
        h = F.dropout(self.proj(x), p=0.3, training=self.training)
        q = h.reshape(len(x), 5, 2, 4).transpose(1, 2)  # (B, heads, 5, 4)
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.4, is_causal=True)
        return out.transpose(1, 2).reshape(len(x), 5, 8)


def _forward(net: nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """Every sample's output, in micro-batches of ``rows``."""
    outs = []
    for offset in range(0, len(x), rows):
        draws = _draws(offset, rows)
        forward = ForwardDraws(net, draws, batch_dim=0, keyed=True)
        outs.append(net(x[offset : offset + rows]))
        forward.remove()
    return torch.cat(outs)


def test_functional_dropout_is_keyed_per_sample_whatever_the_micro_batch():
    torch.manual_seed(0)
    net, x = FunctionalNet(), torch.randn(8, 5, 8)
    whole, pairs = _forward(net, x, 8), _forward(net, x, 2)
    assert torch.equal(whole, pairs)
    net.eval()
    assert not torch.equal(whole, net(x))  # it dropped out in training


def test_a_forward_that_raises_leaves_no_mode_behind():
    class Fails(nn.Module):
        def forward(self, x):
            F.dropout(x, 0.5)
            raise RuntimeError("the user's bug")

    net = Fails()
    ForwardDraws(net, _draws(0, 2), batch_dim=0, keyed=True)
    depth = torch._C._len_torch_function_stack()
    with pytest.raises(RuntimeError, match="the user's bug"):
        net(torch.ones(2, 3))
    assert torch._C._len_torch_function_stack() == depth


def _said(capfd, words: str) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if words in line]


def _one_epoch(model: nn.Module, body=None, **options) -> None:
    run = ddpkit.Run(**({"global_batch": 8, "micro_batch": 4, "progress": False} | options))
    try:
        model = run.setup(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.track(optimizer)
        data = torch.utils.data.TensorDataset(torch.randn(16, 6), torch.randn(16, 2))
        for x, y in run.loader(data):
            x = body(run, x) if body is not None else x
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()
    finally:
        run.close()


def test_dropout_modules_that_run_are_named_once_and_unused_ones_are_not(capfd):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.unused = nn.Sequential(nn.Linear(6, 2), nn.Dropout(0.1)), nn.Dropout(0.2)

        def forward(self, x):
            return F.dropout(self.body(x), p=self.unused.p)  # the module's p, as transformers passes it

    _one_epoch(Net())
    said = _said(capfd, "drops out in")
    assert len(said) == 1, said
    assert "Net drops out in body.1 (F.dropout(p=0.1)), Net (F.dropout(p=0.2))" in said[0], said
    assert "unused" not in said[0] and "invariant_dropout=True" in said[0]


def test_a_draw_from_numpys_generator_in_the_loop_is_said_unless_the_batch_was_gathered(capfd):
    def mixup(run, x):  # in-loop Mixup, pairing within the micro-batch
        lam = float(np.random.beta(0.4, 0.4))
        return lam * x + (1 - lam) * x.flip(0)

    _one_epoch(nn.Linear(6, 2), mixup)
    said = _said(capfd, "the loop body drew from")
    assert len(said) == 1 and "numpy's np.random" in said[0] and "run.all_gather" in said[0], said

    def gathered(run, x):
        np.random.beta(0.4, 0.4)
        run.all_gather(x)
        return x

    _one_epoch(nn.Linear(6, 2), gathered, micro_batch=None)
    assert not _said(capfd, "the loop body drew from")


def test_torch_draws_the_option_does_not_key_are_named_with_their_module(capfd):
    class DropPath(nn.Module):
        def forward(self, x):  # stochastic depth written by hand, with no drop_prob to key
            return x * (torch.rand(len(x), 1) > 0.1) / 0.9

    _one_epoch(nn.Sequential(nn.Linear(6, 2), DropPath()), invariant_dropout=True)
    said = _said(capfd, "draws from torch's global generator in")
    assert len(said) == 1 and "1 (rand)" in said[0], said
    assert not _said(capfd, "the loop body drew from")  # the forward's draw explains torch's state


def test_batchnorm_in_training_mode_is_said_with_the_forwards_samples(capfd):
    _one_epoch(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    said = _said(capfd, "BatchNorm in training mode in 1 ")
    assert len(said) == 1 and "(4 here, of a global batch of 8)" in said[0], said
    frozen = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4).eval(), nn.Linear(4, 2))
    _one_epoch(frozen)
    assert not _said(capfd, "BatchNorm in training mode")


def test_a_summed_loss_weighed_as_a_mean_is_said_once(capfd):
    run = ddpkit.Run(global_batch=8, micro_batch=4, progress=False)
    try:
        model = run.setup(nn.Linear(6, 2))
        data = torch.utils.data.TensorDataset(torch.randn(16, 6), torch.randn(16, 2))
        loader = run.loader(data)
        for x, y in loader:
            run.backward(F.mse_loss(model(x), y, reduction="sum"))
        for x, y in loader:  # said once a run
            run.backward(F.mse_loss(model(x), y, reduction="sum"))
    finally:
        run.close()
    said = _said(capfd, "run.backward got a loss summed over the batch")
    assert len(said) == 1 and "MseLossBackward0" in said[0] and 'reduction="sum"' in said[0], said


def test_a_plain_loop_hears_nothing(capfd):
    _one_epoch(
        nn.Sequential(nn.Linear(6, 4), nn.GELU(), nn.Dropout(0.2), nn.Linear(4, 2)), invariant_dropout=True
    )
    err = capfd.readouterr().err
    assert "generator" not in err and "drops out" not in err and "BatchNorm" not in err, err
