"""`ddpkit train` end to end on 2 gloo processes, and its one-line errors for bad input."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch
from helpers import ddpkit_cli

from ddpkit.cli import main
from ddpkit.models.convnet import ConvNet
from ddpkit.models.toy import ToyModel


def _train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddpkit", "train", *args]
    return ddpkit_cli(cmd, capture_output=True, text=True, timeout=timeout)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_toy_trains_logs_and_saves(tmp_path):
    out = tmp_path / "toy"
    done = _train("toy", "--nproc", "2", "--steps", "60", "--log-every", "10", "--out", str(out))
    assert done.returncode == 0, done.stderr
    records = _records(out)
    assert [r["step"] for r in records] == [1, 10, 20, 30, 40, 50, 60]
    assert {"step", "loss", "samples_per_s", "lr"} <= set(records[0])
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    state = torch.load(out / "model.pt", weights_only=True)
    ToyModel().load_state_dict(state)  # strict: same keys and shapes as the bare model
    assert (out / "loss.png").stat().st_size > 1000
    saved = json.loads((out / "config.json").read_text())
    assert saved["data"]["global_batch"] == 64 and saved["train"]["task"] == "toy"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000050", "step-00000060"]


@pytest.mark.slow
def test_convnet_trains_on_bundled_digits(tmp_path):
    out = tmp_path / "convnet"
    done = _train("convnet", "--nproc", "2", "--steps", "30", "--log-every", "15", "--out", str(out))
    assert done.returncode == 0, done.stderr
    records = _records(out)
    assert records[-1]["loss"] < records[0]["loss"]
    ConvNet(num_classes=10, image_size=8).load_state_dict(torch.load(out / "model.pt", weights_only=True))


@pytest.mark.slow
def test_gpt_trains_and_prints_a_sample(tmp_path):
    out = tmp_path / "gpt"
    done = _train(
        "gpt", "--nproc", "2", "--steps", "8", "--log-every", "4", "--global-batch", "8", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in _records(out)] == [1, 4, 8]
    assert "--- sample ---" in done.stdout
    assert len((out / "sample.txt").read_text()) > 100
    state = torch.load(out / "model.pt", weights_only=True)
    assert torch.equal(state["lm_head.weight"], state["wte.weight"])  # tied embeddings survive the save


def test_existing_out_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["train", "toy", "--out", str(tmp_path)]) == 2
    assert (
        "already holds a run; pass --resume auto to continue it, --overwrite to replace it"
        in capsys.readouterr().err
    )
    # --overwrite replaces ddpkit runs only, never a directory of the user's own files.
    assert main(["train", "toy", "--out", str(tmp_path), "--overwrite"]) == 2
    assert "not a ddpkit run" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"


BAD_INPUT = [
    (["--nproc", "0"], "--nproc 0 is below 1"),
    (["resnet"], "unknown workload 'resnet'; choose one of gpt, convnet, toy"),
    (["--data", "/no/such/file.txt"], "--data '/no/such/file.txt' is not a file"),
    (["convnet", "--data", "/no/such/dir"], "--data '/no/such/dir' is not a directory"),
    (["--backend", "nccl", "--nproc", "2"], "backend nccl needs one GPU per process"),
    (
        ["toy", "--nproc", "2", "--global-batch", "9"],
        "--global-batch 9 cannot be split evenly across 2 processes",
    ),
    (
        ["toy", "--nproc", "2", "--nnodes", "1:2", "--global-batch", "6"],
        "cannot be split evenly across 4 processes",
    ),
    (["--steps", "0"], "--steps 0 is below 1"),
    (["--engine", "jax"], "unknown --engine 'jax'"),
    (["--stpes", "3"], "unrecognized arguments: --stpes"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_is_one_line_with_exit_code_2(tmp_path, capsys, args, message):
    if "nccl" in args and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs that make the nccl request valid")
    assert main(["train", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_master_port_in_use(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["train", "toy", "--master-port", str(port), "--out", str(tmp_path / "o")]) == 2
    assert f"--master-port {port} is already in use" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["bench", "--help"]) == 0 and "engine" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    assert "``" not in capsys.readouterr().out  # the docstrings' reST quotes stay out of the help


@pytest.mark.slow
def test_real_process_exit_code_and_no_traceback():
    done = _train("--nproc", "0", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "ddpkit: error: --nproc 0 is below 1; use a positive integer or auto"
