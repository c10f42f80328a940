"""transformers' models as they come, built from configs, under ``invariant_dropout=True``.

Each family drops out inside attention through a function (``F.dropout`` in the eager path,
``scaled_dot_product_attention(dropout_p=...)`` in sdpa) and in ``nn.Dropout`` modules elsewhere.
In a world of one, a step in one micro-batch of 8 and in four of 2 must give the same losses
(the masks are keyed by the sample, not by the micro-batch that holds it), also with activation
checkpointing, which recomputes the forward in the backward; and nothing is left for rank 0 to
say about dropout.
"""

from __future__ import annotations

import pytest
import torch

import ddpkit

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SEQ, VOCAB = 12, 40


def _model(family: str, attention: str) -> tuple[torch.nn.Module, str]:
    """A tiny model of ``family`` with dropout 0.1 everywhere, and its block's class name."""
    small = {
        "vocab_size": VOCAB,
        "num_attention_heads": 2,
        "hidden_size": 16,
        "attn_implementation": attention,
    }
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=SEQ, attn_implementation=attention
        )
        return transformers.GPT2LMHeadModel(config), "GPT2Block"
    if family == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=2, num_key_value_heads=1, intermediate_size=32, attention_dropout=0.1, **small
        )
        return transformers.LlamaForCausalLM(config), "LlamaDecoderLayer"
    config = transformers.BertConfig(
        num_hidden_layers=2, intermediate_size=32, max_position_embeddings=SEQ, **small
    )
    return transformers.BertForMaskedLM(config), "BertLayer"


def _losses(family: str, attention: str, micro_batch: int, recompute: bool) -> list[float]:
    run = ddpkit.Run(
        global_batch=8, micro_batch=micro_batch, invariant_dropout=True, progress=False, seed=5,
        log_every=1, checkpoint_modules=[_model(family, attention)[1]] if recompute else [],
    )  # fmt: skip
    try:
        torch.manual_seed(0)
        model = run.setup(_model(family, attention)[0])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run.track(optimizer)
        ids = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(1))
        losses = []
        for (x,) in run.loader(torch.utils.data.TensorDataset(ids)):
            loss = model(input_ids=x, labels=x, use_cache=False).loss if family != "bert" else None
            loss = model(input_ids=x, labels=x).loss if loss is None else loss
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            losses.append(loss.item() * len(x) / 8)
        return [sum(losses[i : i + 8 // micro_batch]) for i in range(0, len(losses), 8 // micro_batch)]
    finally:
        run.close()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_attention_dropout_is_keyed_per_sample_in_any_micro_batch(family, attention, capfd):
    whole = _losses(family, attention, 8, False)
    pairs = _losses(family, attention, 2, False)
    recomputed = _losses(family, attention, 2, True)
    assert whole == pytest.approx(pairs, rel=1e-6), (whole, pairs)
    assert pairs == pytest.approx(recomputed, rel=1e-6), (pairs, recomputed)
    err = capfd.readouterr().err
    assert "drops out in" not in err and "global generator" not in err, err
