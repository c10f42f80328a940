"""``ddpkit bench data`` on tiny sizes: it reports finite positive ratios, and its datasets draw
what they claim to, from the generators they claim to (times are the benchmark's, not a test's)."""

from __future__ import annotations

import json
import math

from ddpkit.bench.data_bench import datasets, main
from ddpkit.run.data.map_source import EpochIndices
from ddpkit.run.invariant.seeding import SeededFetch


def test_tiny_run_reports_finite_positive_ratios(tmp_path, capsys):
    argv = ["--batch", "4", "--batches", "2", "--rounds", "1", "--workers", "0"]
    assert main([*argv, "--json", str(tmp_path / "data.json")]) == 0
    rows = json.loads((tmp_path / "data.json").read_text(encoding="utf-8"))["datasets"]
    assert set(rows) == {"tensor", "fixed", "crop", "globals", "sample_rng"}
    for row in rows.values():
        assert math.isfinite(row["workers_0"]["ratio"]) and row["workers_0"]["ratio"] > 0, row
        assert row["plain_us_per_sample"] > 0 and row["seeded_us_per_sample"] > 0, row
    assert "target: crop >= 0.8" in capsys.readouterr().out


def test_the_benchmarks_datasets_draw_from_the_generators_they_name():
    expected = {"tensor": set(), "fixed": set(), "crop": {"rng"}, "globals": {"random", "numpy", "torch"}}
    expected["sample_rng"] = set()  # draws from ddpkit.sample_rng() alone: nothing watched
    for name, dataset in datasets(8).items():
        fetch = SeededFetch(dataset, seed=0)
        indices = EpochIndices([0, 1, 2])
        indices.epoch = 0
        fetch.__getitems__(indices)
        assert fetch.drawn == expected[name], name
