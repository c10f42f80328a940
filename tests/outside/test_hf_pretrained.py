"""Fine-tuning a pretrained HuggingFace model as a user would: a tiny LlamaForCausalLM with random
weights written by ``save_pretrained`` (safetensors, sharded into several files) into the test's
own folder, built empty and loaded with ``run.setup(model, weights=folder)`` on 2 processes.
fsdp equals the torch engine within 1e-5, and both start from the folder's tensors to the bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.launch.start_method import FORKSERVER

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from hf_pretrained_cases import CONFIG, both_engines  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_save_pretrained_folder_fine_tunes_alike_on_fsdp_and_the_torch_engine(tmp_path):
    torch.manual_seed(0)
    pretrained = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    pretrained.save_pretrained(tmp_path / "llama", max_shard_size="50KB")
    assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()  # the sharded layout
    saved = pretrained.state_dict()
    runs = ddpkit.launch(both_engines, 2, (str(tmp_path / "llama"),), start_method=FORKSERVER)
    for rank, engines in enumerate(runs):
        for engine, result in engines.items():
            assert all(torch.equal(result["first"][k], saved[k]) for k in saved), (rank, engine)
        torch.testing.assert_close(
            engines["fsdp"]["losses"], engines["torch"]["losses"], rtol=1e-5, atol=1e-6
        )
        for key, value in engines["torch"]["last"].items():
            torch.testing.assert_close(engines["fsdp"]["last"][key], value, rtol=1e-5, atol=1e-6, msg=key)
