"""ddpkit bench scaling: the timing window, efficiency, batch rules, and a short real run."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from ddpkit.bench import scaling
from ddpkit.errors import ConfigError


def test_timed_trainer_times_only_the_steps_after_warmup(monkeypatch):
    # perf_counter at the end of step 1, of step 2 (the warm-up's end), of step 5 (the last)
    ticks = iter([100.0, 105.0, 108.0])
    monkeypatch.setattr(scaling.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(scaling.Trainer, "_run_batch", lambda self, batch: None)  # no real step
    trainer = scaling.TimedTrainer.__new__(scaling.TimedTrainer)
    trainer.warmup, trainer.total_steps = 2, 5
    trainer.run = SimpleNamespace(step=0, at_step_end=True, device=torch.device("cpu"))
    for step in range(1, 6):
        trainer.run.step = step
        trainer._run_batch(None)
    samples_per_s, step_s = trainer.throughput(global_batch=64)
    assert math.isclose(step_s, 1.0) and math.isclose(samples_per_s, 64.0)  # 3 steps in 3 s


def test_efficiency_is_speedup_over_added_processes_per_engine():
    records = [
        {"engine": "ddp", "nproc": 1, "samples_per_s": 100.0},
        {"engine": "ddp", "nproc": 2, "samples_per_s": 150.0},
        {"engine": "ddp", "nproc": 4, "samples_per_s": 400.0},
        {"engine": "dataparallel", "nproc": 2, "samples_per_s": 50.0},
        {"engine": "dataparallel", "nproc": 4, "samples_per_s": 50.0},
    ]
    scaling.add_efficiency(records)
    assert [r["speedup"] for r in records] == [1.0, 1.5, 4.0, 1.0, 1.0]
    assert [r["efficiency"] for r in records] == [1.0, 0.75, 1.0, 1.0, 0.5]


def test_strong_scaling_fixes_the_global_batch_and_weak_the_per_process_batch():
    strong = scaling.ScalingConfig(nprocs=(1, 2, 4), global_batch=64)
    assert [strong.batch_at(n) for n in (1, 2, 4)] == [64, 64, 64]
    weak = scaling.ScalingConfig(nprocs=(2, 4), global_batch=64, scaling="weak")
    assert [weak.batch_at(n) for n in (2, 4)] == [64, 128]
    assert strong.train_config(2, "out").values()["log_every"] == strong.steps  # no logging while timed


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"nprocs": (1, 3), "global_batch": 64}, "global_batch=64"),
        ({"nprocs": (2, 1)}, "--nproc"),
        ({"steps": 10, "warmup": 10}, "--warmup 10"),
        ({"scaling": "linear"}, "'linear'"),
        ({"workload": "resnet"}, "'resnet'"),
        ({"threads": 0}, "--threads 0"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_value(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        scaling.ScalingConfig(**kwargs)


def test_nproc_list_parsing():
    assert scaling.parse_nprocs("1,2, 4") == (1, 2, 4)
    with pytest.raises(ConfigError, match="'1,two'"):
        scaling.parse_nprocs("1,two")


@pytest.mark.slow
def test_short_toy_run_writes_a_record_per_process_count(tmp_path, capsys):
    out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    argv = ["toy", "--nproc", "1,2", "--steps", "6", "--warmup", "2", "--global-batch", "32"]
    assert scaling.main(argv + ["--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    records = data["records"]
    assert [(r["engine"], r["nproc"], r["batch_per_process"]) for r in records] == [
        ("ddp", 1, 32),
        ("ddp", 2, 16),
    ]
    assert all(r["samples_per_s"] > 0 and r["step_ms"] > 0 for r in records)
    assert records[0]["efficiency"] == 1.0
    assert math.isclose(
        records[1]["efficiency"], records[1]["samples_per_s"] / records[0]["samples_per_s"] / 2
    )
    assert data["meta"]["scaling"] == "strong" and data["meta"]["global_batch"] == 32
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "efficiency" in capsys.readouterr().out
