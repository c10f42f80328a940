"""``ddpkit bench trainer`` on a tiny run: finite ratios, MFU from the FLOPs torch counts for one
sample, and the GPT-2-small shape refused for a model that is not a GPT (times are the benchmark's,
not a test's)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ddpkit.bench.trainer_bench import main, per_sample
from ddpkit.errors import ConfigError
from ddpkit.train.job import layered
from ddpkit.train.workloads import WORKLOADS, get_workload


@pytest.mark.slow
def test_tiny_run_reports_ratios_and_mfu(tmp_path, capsys):
    argv = ["toy", "--nproc", "1", "--blocks", "2", "--block", "2", "--device", "cpu", "--peak-flops", "1e11"]
    assert main([*argv, "--json", str(tmp_path / "trainer.json")]) == 0
    loops = json.loads((tmp_path / "trainer.json").read_text(encoding="utf-8"))["loops"]
    assert set(loops) == {"hand", "run", "trainer"}
    for row in loops.values():
        assert 0 < row["mfu"] < 1 and row["peak_cuda_mb"] == 0.0, row
    assert all(math.isfinite(loops[name]["step_ratio"]) for name in ("run", "trainer"))
    assert "plain loop (no DDP)" in capsys.readouterr().out


def test_one_samples_flops_and_tokens_are_counted_for_the_gpt():
    job = get_workload("gpt").build(layered("gpt", WORKLOADS["gpt"].defaults, {}))
    counted = per_sample(job, torch.device("cpu"))
    params = sum(p.numel() for p in job.model.parameters())
    assert counted["tokens"] == job.model.config.block_size
    # Forward and backward of the matmuls: about 6 x parameters x tokens, plus attention's.
    assert 0.5 < counted["flops"] / (6 * params * counted["tokens"]) < 2, counted


def test_the_gpt2_small_shape_is_refused_for_another_model():
    with pytest.raises(ConfigError, match="--gpt small sizes the gpt workload's model"):
        main(["toy", "--gpt", "small", "--device", "cpu", "--nproc", "1"])
