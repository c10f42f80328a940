"""``ddpkit bench engine``: the summary arithmetic, the flags, and one tiny end-to-end run."""

from __future__ import annotations

import json

import pytest

from ddpkit.bench import engine
from ddpkit.cli import main as cli_main
from ddpkit.errors import ConfigError


def _timed(rounds: dict[str, list[list[list[float]]]]) -> dict:
    """Fake ``_timed_rank`` output: rounds[name][rank] = per-round step times."""
    ranks = [
        {
            "rounds": {name: per_rank[r] for name, per_rank in rounds.items()},
            # CPU and wall seconds per engine; rank 1 sat out `solo` nearly idle
            "spent": {name: [0.04, 1.0] if (name, r) == ("solo", 1) else [0.8, 5.0] for name in rounds},
            "comm": {"torch": (2, 19_200_000)},
        }
        for r in range(2)
    ]
    return {"ranks": ranks, "params": 4_800_000, "threads": 1, "nproc": 2}


def test_summary_pairs_rounds_and_takes_the_slowest_rank() -> None:
    timed = _timed(
        {
            # round 1 ran on a quiet machine, round 2 on a busy one; native is 10% faster in both
            "torch": [[[1.0, 1.0], [2.0, 2.0]], [[1.0, 0.5], [2.0, 2.0]]],
            "native": [[[0.9, 0.9], [1.8, 1.8]], [[0.5, 0.9], [1.8, 1.8]]],
            "solo": [[[0.5, 0.5], [1.0, 1.0]], [[], []]],
        }
    )
    summary = engine.summarize(timed, {"native": [500.0, 510.0]})
    rows = summary["engines"]
    assert rows["native"]["vs_torch"] == pytest.approx(0.9)
    assert rows["native"]["round_medians_ms"] == [900.0, 1800.0]  # max over ranks per step
    assert rows["native"]["scaling_efficiency"] == pytest.approx(0.5 / 0.9)
    assert rows["torch"]["bytes_per_step"] == 19_200_000 and rows["native"]["peak_rss_mb"] == [500.0, 510.0]
    assert rows["native"]["cpu_ms_per_step"] == pytest.approx(200.0)  # 0.8 s over 4 steps
    assert rows["solo"]["cpu_ms_per_step"] == pytest.approx(200.0)  # rank 0 only: rank 1 ran no step
    assert summary["solo_idle_rank_cpu_fraction"] == pytest.approx(0.04)
    table = engine.format_table(summary)
    assert "native" in table and "0.900" in table and "500 510" in table


def test_unknown_engine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown names \\['nccl'\\]"):
        engine.EngineBenchConfig(engines=("torch", "nccl"))


def test_tiny_run_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "engine.json"
    flags = "--nproc 2 --blocks 2 --steps-per-block 1 --warmup 1 --batch 2 --seq 8 --n-layer 1 --n-embd 16"
    argv = ["bench", "engine", *flags.split(), "--n-head", "2", "--no-memory", "--json", str(out)]
    assert cli_main(argv) == 0
    summary = json.loads(out.read_text())
    assert set(summary["engines"]) == {"solo", "none", "torch", "native", "native+bf16"}
    traffic = {name: row["bytes_per_step"] for name, row in summary["engines"].items()}
    assert traffic["none"] == 0 and traffic["native+bf16"] * 2 == traffic["native"] == traffic["torch"]
    assert "native+bf16" in capsys.readouterr().out
