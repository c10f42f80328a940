"""A HuggingFace causal LM fine-tuned from a folder that ``save_pretrained`` wrote, built empty and
given the folder's weights at run.setup, on the torch and fsdp engines: what
tests/outside/test_hf_pretrained.py launches on 2 processes."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ddpkit

CONFIG = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip


def fine_tune(engine: str, folder: str) -> dict:
    """This rank's losses, and the weights before and after 4 AdamW steps."""
    run = ddpkit.Run(global_batch=8, engine=engine, progress=False)
    with ddpkit.empty_init():  # parameters on meta; the rotary table stays real
        net = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model = run.setup(net, weights=folder)

    def state() -> dict:
        module = getattr(model, "module", model)
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in module.state_dict().items()
        }

    first = state()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run.track(optimizer)
    tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for (ids,) in run.loader(torch.utils.data.TensorDataset(tokens)):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        run.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    last = state()
    run.finish()
    return {"first": first, "last": last, "losses": losses}


def both_engines(folder: str) -> dict:
    return {engine: fine_tune(engine, folder) for engine in ("torch", "fsdp")}
