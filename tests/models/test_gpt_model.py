"""Tests for the GPT model: shapes, weight tying, causality, generation and config checks."""

import pytest
import torch

from ddpkit.models.gpt import GPT, GPTConfig


def _tiny_config(**overrides) -> GPTConfig:
    fields = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    fields.update(overrides)
    return GPTConfig(**fields)


def _model(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(_tiny_config(**overrides)).eval()


def test_forward_returns_logits_per_position():
    idx = torch.randint(0, 11, (3, 5))
    assert _model()(idx).shape == (3, 5, 11)


def test_lm_head_shares_storage_with_token_embedding():
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    # An update through one name must show through the other.
    with torch.no_grad():
        model.wte.weight[0, 0] = 123.0
    assert model.lm_head.weight[0, 0].item() == 123.0


def test_num_params_counts_tied_weight_once():
    model = _model()
    distinct = {id(p): p.numel() for p in model.parameters()}
    assert model.num_params() == sum(distinct.values())
    all_named = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert all_named - model.num_params() == 11 * 16


def test_changing_a_later_token_leaves_earlier_logits_unchanged():
    model = _model()
    idx = torch.randint(0, 11, (2, 8))
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 11
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_forward_rejects_sequence_longer_than_block_size():
    with pytest.raises(ValueError, match="exceeds block_size 8"):
        _model()(torch.zeros(1, 9, dtype=torch.long))


def test_generate_appends_tokens_and_keeps_prompt():
    model = _model()
    prompt = torch.randint(0, 11, (2, 3))
    out = model.generate(prompt, max_new_tokens=12)  # longer than block_size: context is cropped
    assert out.shape == (2, 15)
    assert torch.equal(out[:, :3], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < 11


def test_generate_is_reproducible_with_a_generator():
    model = _model()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = model.generate(prompt, 10, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 10, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_generate_with_top_k_one_is_greedy():
    model = _model()
    prompt = torch.tensor([[1, 2]])
    out = model.generate(prompt, 1, top_k=1)
    assert out[0, -1].item() == model(prompt)[0, -1].argmax().item()


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(top_k=0)])
def test_generate_rejects_bad_sampling_arguments(kwargs):
    with pytest.raises(ValueError):
        _model().generate(torch.zeros(1, 1, dtype=torch.long), 1, **kwargs)


def test_residual_projections_use_depth_scaled_init():
    torch.manual_seed(0)
    model = GPT(_tiny_config(n_layer=8, n_embd=64, n_head=4))
    proj_std = model.h[0].mlp.c_proj.weight.std().item()
    fc_std = model.h[0].mlp.c_fc.weight.std().item()
    assert proj_std == pytest.approx(0.02 / 4.0, rel=0.1)
    assert fc_std == pytest.approx(0.02, rel=0.1)


def test_bias_false_removes_all_biases():
    model = _model(bias=False)
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]


def test_config_rejects_n_embd_not_divisible_by_n_head():
    with pytest.raises(ValueError, match=r"n_embd \(10\) must be divisible by n_head \(4\)"):
        _tiny_config(n_embd=10, n_head=4)


@pytest.mark.parametrize("field", ["vocab_size", "block_size", "n_layer", "n_head", "n_embd"])
def test_config_rejects_non_positive_sizes(field):
    with pytest.raises(ValueError, match=field):
        _tiny_config(**{field: 0})


def test_config_rejects_dropout_out_of_range():
    with pytest.raises(ValueError, match="dropout"):
        _tiny_config(dropout=1.0)


def test_config_is_frozen():
    config = _tiny_config()
    with pytest.raises(AttributeError):
        config.n_layer = 3
