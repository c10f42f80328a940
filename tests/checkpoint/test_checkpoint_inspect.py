"""`ddpkit inspect`: what it prints for checkpoints, directories of them and .pt files; its exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401 - AdamW's first step imports it, which sets TORCHINDUCTOR_CACHE_DIR
from torch import nn

import ddpkit
from ddpkit.checkpoint import save_checkpoint
from ddpkit.checkpoint.inspect import brief, format_bytes, main


def model_and_state(step: int) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()  # (B, in_features) -> (B, 2)
    optimizer.step()
    model[2].to(torch.bfloat16)  # two dtypes, for the summary to list
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": {"epoch": 1, "consumed": 96},
    }
    return model, state


@pytest.fixture
def run(tmp_path) -> Path:
    """A run directory: OUT/checkpoints with two checkpoints, and OUT/model.pt."""
    model, _ = model_and_state(0)
    for step in (100, 200):
        save_checkpoint(tmp_path / "checkpoints", step, model_and_state(step)[1])
    torch.save(model.state_dict(), tmp_path / "model.pt")
    return tmp_path


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_good_checkpoint(run, capsys):
    path = run / "checkpoints" / "step-00000200"
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((path / "manifest.json").read_text())
    size = format_bytes(manifest["files"]["state.pt"]["bytes"])
    assert out.startswith(f"checkpoint {path}\n")
    for line in (
        "  step            200",
        f"  created         {manifest['created']}",
        f"  ddpkit_version  {ddpkit.__version__}",
        f"  state.pt        {size:>10}  xxh3_128 ok",
        "  state: 4 keys: step, model, optimizer, sampler",
    ):
        assert line + "\n" in out, line
    # 8*16 + 16 + 16*2 + 2 = 178 parameters; the first layer float32, the second bfloat16.
    assert "model      4 tensors, 178 parameters, bfloat16/float32; 0.weight (16, 8), 0.bias (16,), " in out
    assert "optimizer  {'state': dict(4 entries), 'param_groups': list(1 item)}" in out
    assert "sampler    {'epoch': 1, 'consumed': 96}" in out
    assert "MISMATCH" not in out and "PROBLEM" not in out


def test_a_directory_of_checkpoints_with_one_corrupt(run, capsys):
    flip_byte(run / "checkpoints" / "step-00000100" / "state.pt")
    for path in (run / "checkpoints", run):  # a run's --out finds its checkpoints/ too
        assert main([str(path)]) == 1
        out = capsys.readouterr().out
        assert out.startswith(f"2 checkpoints in {run / 'checkpoints'}\n")
        _, first, second = out.split("\n\ncheckpoint ")
        assert "MISMATCH (xxh3_128 mismatch in state.pt)" in first and "state not loaded" in first
        assert "xxh3_128 ok" in second and "178 parameters" in second


def test_a_truncated_checkpoint(run, capsys):
    state = run / "checkpoints" / "step-00000200" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    assert main([str(state)]) == 1  # state.pt inside a checkpoint: the whole checkpoint is checked
    out = capsys.readouterr().out
    assert "MISMATCH (size mismatch in state.pt (100 bytes, manifest says" in out


def test_a_checkpoint_without_manifest(run, capsys):
    path = run / "checkpoints" / "step-00000200"
    (path / "manifest.json").unlink()
    assert main([str(path)]) == 1
    assert "PROBLEM: missing manifest.json" in capsys.readouterr().out


def test_a_model_file(run, capsys):
    assert main([str(run / "model.pt")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"file {run / 'model.pt'}\n")
    assert "(no manifest to check it against)" in out
    assert "state: 4 tensors, 178 parameters, bfloat16/float32; 0.weight (16, 8)" in out


def test_a_damaged_model_file(run, capsys):
    path = run / "model.pt"
    path.write_bytes(path.read_bytes()[:200])
    assert main([str(path)]) == 1
    assert "PROBLEM: cannot load model.pt" in capsys.readouterr().out


def test_a_directory_without_checkpoints(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "no checkpoint here" in capsys.readouterr().out


def test_a_missing_path_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main([str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"ddpkit: error: '{missing}' does not exist; pass a checkpoint directory")
    assert main([]) == 2
    assert "required: path" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (torch.zeros(2, 3, dtype=torch.float16), "float16[2, 3]"),
        (torch.tensor(5), "tensor(5)"),
        ({"a": [1, 2], "b": {"c": 1}}, "{'a': list(2 items), 'b': dict(1 entry)}"),
        (list(range(10)), "list(10 items)"),
        ("x" * 200, "'" + "x" * 96 + "..."),
    ],
)
def test_brief(value, text):
    assert brief(value) == text


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 << 30, "3.0 GiB")]
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text
