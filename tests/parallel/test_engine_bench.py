"""``ddpkit bench engine``: the summary arithmetic, the flags, and one tiny end-to-end run."""

from __future__ import annotations

import json
import statistics

import pytest

from ddpkit.bench import engine_rounds, engine_summary
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
    summary = engine_summary.summarize(timed, {"native": [500.0, 510.0]})
    rows = summary["engines"]
    assert rows["native"]["vs_torch"] == pytest.approx(0.9)
    assert rows["native"]["round_medians_ms"] == [900.0, 1800.0]  # max over ranks per step
    assert rows["native"]["scaling_efficiency"] == pytest.approx(0.5 / 0.9)
    assert rows["torch"]["bytes_per_step"] == 19_200_000 and rows["native"]["peak_rss_mb"] == [500.0, 510.0]
    assert rows["native"]["cpu_ms_per_step"] == pytest.approx(200.0)  # 0.8 s over 4 steps
    assert rows["solo"]["cpu_ms_per_step"] == pytest.approx(200.0)  # rank 0 only: rank 1 ran no step
    assert summary["solo_idle_rank_cpu_fraction"] == pytest.approx(0.04)
    table = engine_summary.format_table(summary)
    assert "native" in table and "0.900" in table and "500 510" in table


def _rows(**ratios: float) -> dict[str, dict]:
    return {name.replace("_", "+"): {"vs_torch": ratio} for name, ratio in ratios.items()}


def test_targets_report_met_missed_and_the_no_communication_floor() -> None:
    rows = _rows(none=0.94, torch=1.0, native=0.99, native_bf16=0.97)
    rows["native"]["peak_rss_mb"], rows["torch"]["peak_rss_mb"] = [550.0, 560.0], [600.0, 590.0]
    found = {t["target"]: t for t in engine_summary.targets(rows)}
    assert found["native / torch <= 1.00"]["met"] and not found["native+bf16 / torch <= 0.85"]["met"]
    assert found["peak RSS native <= torch"]["measured"] == [560.0, 600.0]
    assert found["peak RSS native <= torch"]["met"]
    text = engine_summary.format_targets(list(found.values()))
    floor = "missed: below the floor, 0.940 of torch (the step without any communication)"
    assert f"0.970 [0.970, 0.970]  {floor}" in text
    assert "560 vs 600 MB  met" in text


def test_a_missed_target_above_the_floor_is_missed_or_within_noise() -> None:
    rows = _rows(none=0.7, native=1.02)
    text = engine_summary.format_targets(engine_summary.targets(rows))
    assert text.endswith("1.020 [1.020, 1.020]  missed")
    rows["native"]["vs_torch_interval90"] = (0.99, 1.03)
    text = engine_summary.format_targets(engine_summary.targets(rows))
    assert text.endswith(
        "1.020 [0.990, 1.030]  missed, within noise: the 90% interval of the median holds the limit"
    )


def test_interval90_brackets_the_median_and_is_repeatable() -> None:
    ratios = [0.95, 0.97, 0.99, 1.0, 1.01, 1.02, 1.04, 1.3]
    low, high = engine_summary.interval90(ratios)
    assert low <= statistics.median(ratios) <= high and (low, high) == engine_summary.interval90(ratios)
    assert (low, high) == pytest.approx((0.98, 1.03))  # the one outlier, 1.3, barely moves it
    assert engine_summary.interval90([1.0] * 5) == (1.0, 1.0)


def test_unknown_engine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown names \\['nccl'\\]"):
        engine_rounds.EngineBenchConfig(engines=("torch", "nccl"))


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "engine.json"
    flags = "--nproc 2 --blocks 2 --steps-per-block 1 --warmup 1 --batch 2 --seq 8 --n-layer 1 --n-embd 16"
    argv = ["bench", "engine", *flags.split(), "--n-head", "2", "--no-memory", "--json", str(out)]
    assert cli_main(argv) == 0
    summary = json.loads(out.read_text())
    assert set(summary["engines"]) == {"solo", "none", "torch", "native", "native+bf16"}
    traffic = {name: row["bytes_per_step"] for name, row in summary["engines"].items()}
    assert traffic["none"] == 0 and traffic["native+bf16"] * 2 == traffic["native"] == traffic["torch"]
    printed = capsys.readouterr().out
    assert "native+bf16" in printed and "target native / torch <= 1.00" in printed
    assert [t["target"] for t in summary["targets"]] == [
        "native / torch <= 1.00",
        "native+bf16 / torch <= 0.85",
    ]


def test_negative_threads_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--threads -1 is negative"):
        engine_rounds.EngineBenchConfig(threads=-1)
