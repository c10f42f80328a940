"""A peft LoRA fine-tune on ddpkit.Run, checked from outside (tests/outside/peft_script.py).

A tiny GPT-2 wrapped by ``get_peft_model`` with LoRA on ``c_attn`` trains two epochs on 2
processes. Three launches of ``ddpkit run``, shared by the tests: uninterrupted and killed at step
KILL side by side, then the killed one's command again.

What ``run.finish()`` writes as OUT/model.pt for a ``PeftModel`` is the PeftModel's own state dict:
the base model's tensors and the adapter's, under peft's prefixes (``base_model.model.``, the
wrapped layer's ``base_layer.``, the adapter's name ``default``), e.g.
``base_model.model.transformer.h.0.attn.c_attn.base_layer.weight`` and
``base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight``. A user gets the adapter
back with ``load_state_dict`` into a fresh ``get_peft_model(...)``, or only the adapter with
peft's ``get_peft_model_state_dict(model, state_dict=...)`` and ``set_peft_model_state_dict``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import peft
import pytest
import torch
from helpers import ddpkit_runs_at_once, logged_losses, saved_weights
from peft_script import SEQUENCES, CountingSequences, build_base, build_model
from safetensors.torch import load_file

pytestmark = [
    pytest.mark.slow,
    # transformers' own, from peft's get_peft_model on transformers 5
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

SCRIPT = Path(__file__).with_name("peft_script.py")
STEPS, KILL = 12, 9  # 2 epochs of 6 steps; killed at the end of step 9: step 8's checkpoint stays


def _launch_all(root: Path, runs: dict[str, tuple[Path, tuple[str, ...]]]) -> dict[str, int]:
    """``ddpkit run --nproc 2 SCRIPT --out OUT EXTRA`` for every ``name: (OUT, EXTRA)`` at once;
    each one's exit code (its output in ROOT/NAME.log)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    commands = {
        name: ["--nproc", "2", str(SCRIPT), "--out", str(out), *extra] for name, (out, extra) in runs.items()
    }
    return ddpkit_runs_at_once(root, commands, env)


@pytest.fixture(scope="module")
def outs(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted run's folder and the killed-and-run-again one's, each run checked to have
    exited as it should."""
    root = tmp_path_factory.mktemp("lora")
    whole, rerun = root / "whole", root / "rerun"
    codes = _launch_all(root, {"whole": (whole, ()), "killed": (rerun, ("--kill-at", str(KILL)))})
    if codes["killed"] == 1:
        codes |= _launch_all(root, {"rerun": (rerun, ())})
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(root.glob("*.log")))
    assert codes == {"whole": 0, "killed": 1, "rerun": 0}, logs
    return {"whole": whole, "rerun": rerun}


def _is_lora(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def _logits(model: torch.nn.Module) -> torch.Tensor:
    batch = CountingSequences(SEQUENCES)[:4]  # (4, SEQ) input_ids and labels
    with torch.no_grad():
        return model.eval()(input_ids=batch["input_ids"]).logits


def test_killed_on_2_and_run_again_ends_bit_equal(outs):
    whole, rerun = outs["whole"], outs["rerun"]
    steps = [json.loads(line)["step"] for line in (rerun / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), steps
    losses = logged_losses(whole)
    assert losses[-1] < 0.95 * losses[0], f"the adapter did not learn: {losses}"
    assert logged_losses(rerun) == losses
    theirs, ours = saved_weights(whole), saved_weights(rerun)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], v) for k, v in theirs.items())
    theirs, ours = (load_file(out / "adapter" / "adapter_model.safetensors") for out in [whole, rerun])
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], v) for k, v in theirs.items())


def test_only_the_lora_weights_changed(outs):
    initial, trained = build_model().state_dict(), saved_weights(outs["rerun"])
    assert trained.keys() == initial.keys()
    lora = [k for k in initial if _is_lora(k)]
    assert len(lora) == 4, lora  # lora_A and lora_B of c_attn in each of the 2 layers
    assert all(not torch.equal(trained[k], initial[k]) for k in lora)
    # The frozen base, bit for bit as built: neither the optimizer nor ddpkit touched it.
    assert all(torch.equal(trained[k], v) for k, v in initial.items() if not _is_lora(k))


def test_model_pt_loads_into_a_fresh_peft_model_and_gives_the_adapter_back(outs, tmp_path):
    out = outs["rerun"]
    state = saved_weights(out)
    # OUT/model.pt is the PeftModel's state dict: peft's prefixes, base_layer and the adapter's name.
    assert "base_model.model.transformer.h.0.attn.c_attn.base_layer.weight" in state
    assert state["base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight"].shape == (4, 16)
    assert state["base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight"].shape == (48, 4)

    # 1. The whole state dict into a fresh get_peft_model(...): every tensor as trained.
    whole = build_model()
    whole.load_state_dict(state)
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in state.items())

    # 2. The adapter alone, peft's way: extracted from model.pt, it is what peft's own
    # save_pretrained wrote at the end of the run, and it sets a fresh model's LoRA weights.
    adapter = peft.get_peft_model_state_dict(build_model(), state_dict=state)
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == saved.keys() and all(torch.equal(adapter[k], v) for k, v in saved.items())
    fresh = build_model()
    result = peft.set_peft_model_state_dict(fresh, adapter)
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())

    # 3. The outputs: the same from either fresh model and from PeftModel.from_pretrained on
    # peft's own adapter folder, and the adapter's own (the base alone gives others).
    logits = _logits(whole)
    assert torch.equal(_logits(fresh), logits)
    assert torch.equal(_logits(peft.PeftModel.from_pretrained(build_base(), out / "adapter")), logits)
    with whole.disable_adapter():
        assert not torch.allclose(_logits(whole), logits, atol=1e-3)
