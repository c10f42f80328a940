"""A real transformers model trained by a user's script under ``ddpkit run``, checked from outside.

tests/outside/hf_client_script.py is a single-device HuggingFace loop (GPT2LMHeadModel from a
config, AdamW, ``get_linear_schedule_with_warmup``) with the ddpkit.Run lines added. It runs
three times, side by side: fp32 on 1 and on 2 processes, and bf16 on 2. The tests read what each
run wrote, OUT/metrics.jsonl (loss and lr of every step) and OUT/model.pt (the final weights).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("hf_client_script.py")
STEPS, WARMUP, PEAK_LR = 12, 3, 1e-2
N_EMBD = 32  # the script's GPT2Config(n_embd=32): c_attn.bias is [query | key | value], 32 each
RUNS = {"fp32_1": (1, "fp32"), "fp32_2": (2, "fp32"), "bf16_2": (2, "bf16")}


@dataclass(frozen=True)
class Finished:
    out: Path
    returncode: int
    output: str


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Finished]:
    """The three runs at once: on 2 cores they take ~17 s together against ~21 s one by one."""
    root = tmp_path_factory.mktemp("hf_client")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    started = {}
    try:
        for name, (nproc, precision) in RUNS.items():
            # --standalone: a free rendezvous port, so the runs (and other test files) never collide.
            command = [
                sys.executable, "-m", "ddpkit", "run", "--standalone", "--nproc", str(nproc), str(SCRIPT),
                "--out", str(root / name), "--steps", str(STEPS), "--warmup", str(WARMUP),
                "--lr", str(PEAK_LR), "--precision", precision,
            ]  # fmt: skip
            with open(root / f"{name}.log", "w") as log:
                # Its own session: a run that hangs is killed with its workers, by process group.
                started[name] = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
        for proc in started.values():
            proc.wait(timeout=240)
    finally:
        for proc in started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {
        name: Finished(root / name, proc.returncode, (root / f"{name}.log").read_text())
        for name, proc in started.items()
    }


def finished(runs: dict[str, Finished], name: str) -> Finished:
    run = runs[name]
    assert run.returncode == 0, f"{name} failed (exit {run.returncode}):\n{run.output[-4000:]}"
    return run


def losses(run: Finished) -> list[float]:
    records = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "log_every=1: one line per step"
    return [r["loss"] for r in records]


def weights(run: Finished) -> dict[str, torch.Tensor]:
    return torch.load(run.out / "model.pt", map_location="cpu", weights_only=True)


def split_key_bias(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The attention key biases apart from everything else.

    Softmax is invariant to a shift of every score in a row, and a key bias adds q·b to every
    score of q's row, so its exact gradient is zero. What backward computes is rounding noise
    (~1e-10), and AdamW divides it by its own running size: the key bias takes steps of noise,
    differently for each summation order (1 process or an all-reduce of 2), while staying near 0.
    """
    rest, key_biases = {}, []
    for name, tensor in state.items():
        if name.endswith("attn.c_attn.bias"):
            key_biases.append(tensor[N_EMBD : 2 * N_EMBD])
            tensor = torch.cat([tensor[:N_EMBD], tensor[2 * N_EMBD :]])
        rest[name] = tensor
    return rest, key_biases


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_losses_are_the_same_on_one_and_two_processes(runs):
    one, two = losses(finished(runs, "fp32_1")), losses(finished(runs, "fp32_2"))
    # The comparisons below mean something only for a model that trained: uniform is ln 64 = 4.16.
    assert one[-1] < 0.9 * one[0], f"the loss did not fall by 10% in {STEPS} steps: {one}"
    for step, (a, b) in enumerate(zip(one, two, strict=True), start=1):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: loss {a} on 1 process, {b} on 2"


def test_final_weights_are_the_same_on_one_and_two_processes(runs):
    one, key_one = split_key_bias(weights(finished(runs, "fp32_1")))
    two, key_two = split_key_bias(weights(finished(runs, "fp32_2")))
    difference = max_difference(one, two)
    assert difference <= 1e-5, f"final weights differ by {difference:.3g} between 1 and 2 processes"
    # The key biases (see split_key_bias): noise on both, far below one step at the peak rate.
    for a, b in zip(key_one, key_two, strict=True):
        assert (a - b).abs().max().item() <= 1e-3 and max(a.abs().max(), b.abs().max()).item() <= 1e-3


@pytest.mark.parametrize("name", ["fp32_1", "fp32_2"])
def test_learning_rate_follows_transformers_linear_warmup(runs, name):
    records = (finished(runs, name).out / "metrics.jsonl").read_text().splitlines()
    seen = [json.loads(line)["lr"] for line in records]
    # get_linear_schedule_with_warmup's factor after s scheduler steps; a step runs at the rate
    # that s = step - 1 earlier steps left: 0 first, the peak at step WARMUP + 1, 0 after STEPS.
    expected = [
        PEAK_LR * (s / WARMUP if s < WARMUP else max(0.0, (STEPS - s) / (STEPS - WARMUP)))
        for s in range(STEPS)
    ]
    assert seen == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_bf16_on_two_processes_trains_to_the_fp32_loss_with_its_own_weights(runs):
    bf16, fp32 = finished(runs, "bf16_2"), finished(runs, "fp32_2")
    # The script prints what model(**batch) returned: transformers' ModelOutput (out.loss and
    # out.logits work) in float32, though the forward ran under bf16 autocast.
    assert "12 steps on 2 processes (bf16)" in bf16.output, bf16.output[-4000:]
    assert "loss torch.float32, logits torch.float32" in bf16.output, bf16.output[-4000:]
    bf16_losses, fp32_losses = losses(bf16), losses(fp32)
    assert all(math.isfinite(x) for x in bf16_losses), bf16_losses
    assert fp32_losses[-1] < 0.9 * fp32_losses[0], f"fp32 did not train: {fp32_losses}"
    assert bf16_losses[-1] == pytest.approx(fp32_losses[-1], rel=0.05), (bf16_losses, fp32_losses)
    # bf16 matmuls round to 8 bits of mantissa: weights that matched fp32 to 1e-5 would mean
    # autocast never ran.
    difference = max_difference(split_key_bias(weights(bf16))[0], split_key_bias(weights(fp32))[0])
    assert difference > 1e-3, f"bf16 weights equal fp32's within {difference:.3g}: was autocast on?"
