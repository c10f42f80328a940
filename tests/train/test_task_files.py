"""Your own model in `ddpkit train`: task files, module:build specs, flags generated from the config
dataclasses, `--config run.toml`, and OUT/config.json compared on resume."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ddpkit_cli

from ddpkit.cli import main
from ddpkit.train.command import parse, train_parser
from ddpkit.train.job import SECTIONS

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "task_mlp.py")


def _train(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddpkit", "train", *args]
    return ddpkit_cli(cmd, capture_output=True, text=True, timeout=240)


MLP = [EXAMPLE, "--nproc", "2", "--global-batch", "64", "--lr", "0.05"]


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The example task trained for 30 steps, with checkpoints at steps 15 and 30."""
    out = tmp_path_factory.mktemp("mlp") / "run"
    done = _train(
        *MLP,
        "--out",
        str(out),
        "--steps",
        "30",
        "--save-every",
        "15",
        "--eval-every",
        "15",
        "--log-every",
        "5",
    )
    return out, done


@pytest.mark.slow
def test_a_task_file_trains_with_its_own_optimizer_evaluates_and_resumes(mlp):
    out, first = mlp
    args = [*MLP, "--out", str(out)]
    assert first.returncode == 0, first.stderr[-3000:]
    assert "ddpkit: task_mlp trained to step 30 on 2 processes" in first.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    # The task's StepLR (x0.7 every 20 steps), as the rate each logged step ran at.
    assert [r["lr"] for r in records if r["step"] in (20, 25)] == pytest.approx([0.05, 0.035])
    assert records[-1]["eval_samples"] == 180 and records[-1]["eval_loss"] < 1.0
    # The same settings continue; a changed --steps would make another run, and is refused.
    changed = _train(*args, "--steps", "40", "--resume", "auto")
    assert changed.returncode == 2
    assert "has steps=30 but this command gives 40; pass --steps 30 to continue it" in changed.stderr


@pytest.mark.slow
def test_a_module_build_spec_runs_like_a_file(tmp_path, monkeypatch):
    (tmp_path / "mytask.py").write_text(Path(EXAMPLE).read_text())
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{Path(__file__).parents[2] / 'src'}")
    done = _train("mytask:build", "--global-batch", "32", "--steps", "3", "--out", str(tmp_path / "o"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ddpkit: mytask trained to step 3 on" in done.stdout


BAD_TASKS = [
    ("x = 1\n", "does not define build(cfg); define build(cfg) returning ddpkit.Task"),
    ("def build(cfg):\n    return 3\n", "build(cfg) returned int, not ddpkit.Task"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("source", "message"), BAD_TASKS)
def test_a_file_that_is_not_a_task_is_one_line(tmp_path, source, message):
    task = tmp_path / "bad.py"
    task.write_text(source)
    done = _train(str(task), "--global-batch", "8", "--out", str(tmp_path / "o"))
    assert done.returncode == 2
    assert message in done.stderr and str(task) in done.stderr and "Traceback" not in done.stderr
    assert "failed (exitcode" not in done.stderr  # torch agent's echo of the exit code is dropped


def test_every_config_field_has_a_flag_and_defaults_live_in_the_dataclasses():
    flags = {opt for action in train_parser()._actions for opt in action.option_strings}
    for cls in SECTIONS.values():
        for field in dataclasses.fields(cls):
            if field.name != "task":
                assert "--" + field.name.replace("_", "-") in flags, field.name
    assert "--weight-decay" in flags and "--startup-timeout" in flags
    cfg, _ = parse(["toy", "--weight-decay", "0.3"])
    assert cfg.train.weight_decay == 0.3 and cfg.run.steps == 200  # the workload's default
    assert cfg.optim.on_nonfinite == "stop"  # the dataclass's default, restated nowhere


def test_toml_config_is_layered_under_the_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'task = "toy"\n[data]\nglobal_batch = 48\nmicro_batch = 8\n'
        '[engine]\nengine = "native"\n[train]\nlr = 0.02\n[launch]\nnproc = 3\n'
    )
    cfg, ns = parse(["--config", str(toml), "--lr", "0.05"])
    assert (cfg.train.task, cfg.data.global_batch, cfg.data.micro_batch) == ("toy", 48, 8)
    assert cfg.engine.engine == "native" and cfg.train.lr == 0.05 and str(ns.nproc) == "3"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[engine]\nbucket_cap = 4\n", "unknown key 'bucket_cap' in [engine]; known keys there:"),
        ("[trainer]\nlr = 1\n", "unknown key 'trainer'"),
        ('[train]\nlr = "fast"\n', "lr = 'fast' must be float"),
        ("[launch]\nnprocs = 2\n", "unknown key 'nprocs' in [launch]"),
    ],
)
def test_bad_toml_is_one_line_naming_the_key(tmp_path, capsys, text, message):
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    assert main(["train", "toy", "--config", str(toml), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "inf"], "--lr inf is not finite"),
        (["--out", ""], "--out '' names no folder"),
        (["--weight-decay", "-1"], "--weight-decay -1.0 must be finite and >= 0"),
        ([EXAMPLE], "needs a global batch: pass --global-batch N"),
        (["no/such/task.py"], "task file 'no/such/task.py' does not exist"),
    ],
)
def test_bad_values_are_one_line_in_the_commands_words(tmp_path, capsys, args, message):
    out = [] if "--out" in args else ["--out", str(tmp_path / "o")]
    assert main(["train", *args, *out]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_resume_from_a_checkpoint_of_another_model_is_one_line(tmp_path, mlp):
    out, done = mlp
    assert done.returncode == 0, done.stderr[-2000:]
    checkpoint = out / "checkpoints" / "step-00000030"  # the task's model, resumed into the toy's
    other = _train("toy", "--global-batch", "8", "--resume", str(checkpoint), "--out", str(tmp_path / "o"))
    assert other.returncode == 2
    assert f"cannot resume 'model' from {checkpoint}: it holds another model" in other.stderr
    assert "Traceback" not in other.stderr
