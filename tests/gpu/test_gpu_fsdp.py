"""engine="fsdp" on a GPU: a world of one over NCCL on cuda:0 (tests/run/fsdp_script.py under
``ddpkit run --nproc 1``), and 2 ranks sharing cuda:0 over gloo (NCCL refuses two ranks on one
GPU; each rank hands ``run.engine.wrap`` a DistEnv whose device is cuda:0, as test_gpu_engines.py
does), each against torch's DDP on the same batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks

from ddpkit.models import GPT, GPTConfig
from ddpkit.run import EngineConfig
from ddpkit.run.engine import set_grad_sync, wrap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCRIPT = Path(__file__).parents[1] / "run" / "fsdp_script.py"
STEPS, MICRO, RTOL = 4, 2, 1e-5


def _run(out: Path, *extra: str, code: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "1", str(SCRIPT), "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == code, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def _losses(out: Path) -> list[float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line["loss"] for line in lines if "loss" in line]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True, map_location="cpu")


def test_a_world_of_one_on_nccl_equals_ddp_and_resumes_bit_equal_after_a_kill_inside_its_save(tmp_path):
    _run(tmp_path / "torch", "--engine", "torch", "--micro-batch", "2")
    _run(tmp_path / "fsdp", "--micro-batch", "2")
    assert _losses(tmp_path / "fsdp") == pytest.approx(_losses(tmp_path / "torch"), rel=1e-5)
    for key, value in _weights(tmp_path / "torch").items():
        torch.testing.assert_close(_weights(tmp_path / "fsdp")[key], value, rtol=1e-5, atol=1e-6, msg=key)
    cut = tmp_path / "cut"
    _run(cut, "--micro-batch", "2", "--kill-in-save", "8", code=1)
    assert "resumed from" in _run(cut, "--micro-batch", "2").stdout
    assert all(torch.equal(_weights(cut)[k], v) for k, v in _weights(tmp_path / "fsdp").items())


def _train(engine: str, env, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32))
    model = wrap(model, env, EngineConfig(engine=engine))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(MICRO):
            gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, y = (torch.randint(0, 32, (4, 16), generator=gen).to(env.device) for _ in range(2))
            set_grad_sync([model], micro == MICRO - 1)  # what the step cycle does
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / MICRO
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"losses": losses, "params": {k: v.detach().cpu() for k, v in full.items()}}


def _both_on_cuda_0(env) -> dict:
    on_gpu = dataclasses.replace(env, device=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return {engine: _train(engine, on_gpu, env.rank) for engine in ("torch", "fsdp")}


def test_two_ranks_sharing_cuda_0_train_as_ddp_does():
    for rank, result in enumerate(run_ranks(_both_on_cuda_0, 2, backend="gloo")):
        assert result["fsdp"]["losses"] == pytest.approx(result["torch"]["losses"], rel=RTOL), rank
        for key, expected in result["torch"]["params"].items():
            scale = expected.abs().max().item()
            got = result["fsdp"]["params"][key]
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=RTOL * scale, msg=f"rank {rank} {key}")
