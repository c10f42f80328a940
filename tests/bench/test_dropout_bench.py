"""``ddpkit bench dropout`` on tiny sizes, eager only: it reports finite positive ratios, and the
keyed layer it times multiplies by ``SampleDraws.mask`` (times are the benchmark's, not a test's)."""

from __future__ import annotations

import json
import math

import torch

from ddpkit.bench.dropout_bench import LayerCase, main
from ddpkit.run.invariant import keyed

TINY = ["--batch", "4", "--features", "32", "--gpt-batch", "2", "--block-size", "8", "--n-layer", "1"]
TINY += ["--n-embd", "16", "--rounds", "2", "--per-round", "1", "--warmup", "1", "--no-compile"]


def test_tiny_run_reports_finite_positive_ratios(tmp_path, capsys):
    assert main([*TINY, "--json", str(tmp_path / "dropout.json")]) == 0
    result = json.loads((tmp_path / "dropout.json").read_text(encoding="utf-8"))
    rows = [result["layer"]["eager"], result["gpt"]["eager"]]
    assert "compiled" not in result["layer"] and "compiled" not in result["gpt"]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in rows), rows
    assert all(r["plain_ms"] > 0 and r["keyed_ms"] > 0 for r in rows), rows
    assert result["gpt_keyed_modules"] == 3  # the embedding's, and the block's residual and MLP
    printed = capsys.readouterr().out
    assert "keyed / plain" in printed and "scaled_dot_product_attention(dropout_p=0.1)" in printed


def test_the_timed_keyed_layer_multiplies_by_the_samples_mask():
    case = LayerCase(4, 32, 0.1, torch.device("cpu"), compiled=False)
    out = case.run("keyed")
    # The same step's keys again: key_dropout salts a module by its qualified name ("" at the root).
    case.draws.enter(case.step, case.micro)
    mask = case.draws.mask(keyed.salt("dropout", ""), case.x, 0.1, 32, 0)  # (4, 32), 0 or 1 / 0.9
    assert (mask == 0).any() and (mask > 0).any()  # a mask that drops something, keeps the rest
    assert torch.equal(out, case.x * mask)
