"""GPT-2 with its default dropouts (transformers, as it comes) on 1, 2 and 3 processes.

transformers' GPT-2 drops out in three places: ``nn.Dropout`` modules after the embeddings and
each block's projections, and inside attention, where it passes ``attn_dropout.p`` on to
``scaled_dot_product_attention(dropout_p=...)`` without calling the module. With
``invariant_dropout=True`` all of them are keyed per sample, so one step is the same update on
any world size and micro_batch (tests/outside/hf_client_script.py, global batch 12). Without it,
rank 0 names where the forward drops out, and only where it does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import ddpkit_runs_at_once

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("hf_client_script.py")
STEPS = 4
# name: (processes, micro_batch (0: a rank's share), invariant_dropout)
RUNS = {
    "keyed_1": (1, 0, True),
    "keyed_2": (2, 0, True),
    "keyed_3_micro": (3, 2, True),
    "plain_2": (2, 0, False),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    root = tmp_path_factory.mktemp("hf_dropout")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    commands = {
        name: [
            "--nproc",
            str(nproc),
            str(SCRIPT),
            "--out",
            str(root / name),
            "--steps",
            str(STEPS),
            "--global-batch",
            "12",
            "--micro-batch",
            str(micro),
            "--dropout",
            "0.1",
            "--lr",
            "1e-2",
            "--warmup",
            "1",
            *(["--invariant-dropout"] if keyed else []),
        ]  # fmt: skip
        for name, (nproc, micro, keyed) in RUNS.items()
    }
    codes = ddpkit_runs_at_once(root, commands, env)
    found = {}
    for name, code in codes.items():
        output = (root / f"{name}.log").read_text()
        assert code == 0, f"{name} failed (exit {code}):\n{output[-4000:]}"
        found[name] = (root / name, output)
    return found


def losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


@pytest.mark.parametrize("name", ["keyed_2", "keyed_3_micro"])
def test_gpt2_with_its_dropouts_keyed_takes_the_same_steps_on_any_world_size(runs, name):
    one, other = losses(runs["keyed_1"][0]), losses(runs[name][0])
    for step, (a, b) in enumerate(zip(one, other, strict=True), start=1):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: loss {a} on 1 process, {b} in {name}"
    assert "drops out in" not in runs[name][1]  # every dropout is keyed: nothing to say


def test_without_the_option_the_masks_are_the_ranks_own_and_rank_0_names_where(runs):
    keyed, plain = losses(runs["keyed_2"][0]), losses(runs["plain_2"][0])
    # The same weights at step 1, other masks: dropout is on in both, drawn differently.
    assert abs(keyed[0] - plain[0]) > 1e-4, (keyed, plain)
    said = [line for line in runs["plain_2"][1].splitlines() if "drops out in" in line]
    assert len(said) == 1, said  # rank 0 alone, once
    line = said[0]
    assert "GPT2LMHeadModel drops out in transformer.drop (F.dropout(p=0.1))" in line, line
    assert "transformer.h.0.attn (scaled_dot_product_attention(dropout_p=0.1))" in line, line
    assert "attn_dropout" not in line, line  # its p is passed on; the module itself never runs
    assert "invariant_dropout=True" in line, line
