"""diffusers' unconditional DDPM loop on ddpkit.Run, checked from outside (tests/outside/diffusers_script.py).

A tiny ``UNet2DModel`` trained to predict the noise ``DDPMScheduler.add_noise`` put in, with AdamW,
diffusers' cosine schedule and its ``EMAModel`` (decay warm-up) tracked by the run. Six launches
of ``ddpkit run``, shared by the tests: uninterrupted on 1, 2 and 3 processes and one killed on 2
at step KILL, all four side by side; then the killed run's folder, copied, continues twice side
by side: the same command on 2 processes, and on 3.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DModel
from helpers import ddpkit_runs_at_once, logged_losses, saved_weights
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("diffusers_script.py")
STEPS, KILL = 12, 7  # killed at the end of step 7 (epoch 1's second step): step 6's checkpoint stays


def _launch_all(root: Path, runs: dict[str, tuple[int, Path, tuple[str, ...]]]) -> dict[str, int]:
    """``ddpkit run --nproc N SCRIPT --out OUT --steps STEPS EXTRA`` for every ``name: (N, OUT,
    EXTRA)`` at once; each one's exit code (its output in ROOT/NAME.log)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "DIFFUSERS_VERBOSITY": "error"}
    commands = {
        name: ["--nproc", str(nproc), str(SCRIPT), "--out", str(out), "--steps", str(STEPS), *extra]
        for name, (nproc, out, extra) in runs.items()
    }
    return ddpkit_runs_at_once(root, commands, env)


@pytest.fixture(scope="module")
def outs(tmp_path_factory) -> dict[str, Path]:
    """Every run's folder, each run checked to have exited as it should."""
    root = tmp_path_factory.mktemp("ddpm")
    out = {name: root / name for name in ["one", "two", "three", "rerun_on_2", "resumed_on_3"]}
    first = {
        "one": (1, out["one"], ()),
        "two": (2, out["two"], ()),
        "three": (3, out["three"], ()),
        "killed": (2, out["rerun_on_2"], ("--kill-at", str(KILL))),
    }
    codes = _launch_all(root, first)
    if codes["killed"] == 1:  # the folder the kill left, twice: run again as it was, and on 3
        shutil.copytree(out["rerun_on_2"], out["resumed_on_3"])
        then = {"rerun_on_2": (2, out["rerun_on_2"], ()), "resumed_on_3": (3, out["resumed_on_3"], ())}
        codes |= _launch_all(root, then)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(root.glob("*.log")))
    expected = {"one": 0, "two": 0, "three": 0, "killed": 1, "rerun_on_2": 0, "resumed_on_3": 0}
    assert codes == expected, logs
    return out


KEY_BIAS = "mid_block.attentions.0.to_k.bias"


def _close_but_the_key_bias(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str
) -> None:
    """Every tensor within rtol 1e-5, atol 1e-6, but the attention's key bias: within 1e-3.

    Softmax is invariant to a shift of every score in a row, and the key bias adds q·b to every
    score of q's row, so its exact gradient is zero (3e-20 in float64 here, against 1e-4 for the
    next smallest). What float32 backward computes is rounding noise, and AdamW divides it by its
    own running size: the key bias takes steps of noise, differently for each summation order
    (1, 2 or 3 processes), a fraction of the learning rate (3e-3) each. Measured: 1.6e-4 between
    uninterrupted 1 and 2 processes, 4.8e-6 between 2 and the run killed on 2 and resumed on 3,
    every other tensor within 1e-7.
    """
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if key == KEY_BIAS:
            assert (ours[key] - value).abs().max().item() <= 1e-3, f"{what} {key}"
        else:
            torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=f"{what} {key}")


def _losses(out: Path) -> list[float]:
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), f"log_every=1: one line per step, {steps}"
    return logged_losses(out)


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_every_steps_loss_and_the_weights_are_the_same_on_1_2_and_3_processes(outs):
    one, two, three = (_losses(outs[name]) for name in ["one", "two", "three"])
    # Worth comparing only for a model that learned: the noise's variance is 1 at the start.
    assert min(one[-3:]) < 0.9 * one[0], one
    assert _relative(two, one) <= 1e-5, (one, two)
    assert _relative(three, one) <= 1e-5, (one, three)
    for name in ["two", "three"]:
        _close_but_the_key_bias(
            saved_weights(outs[name]), saved_weights(outs["one"]), f"{name} vs one, model.pt"
        )


def test_killed_on_2_and_run_again_ends_bit_equal(outs):
    whole, rerun = outs["two"], outs["rerun_on_2"]
    assert _losses(rerun) == _losses(whole)
    for name in ["model", "ema"]:
        theirs, ours = saved_weights(whole, name), saved_weights(rerun, name)
        assert theirs.keys() == ours.keys()
        assert all(torch.equal(ours[k], v) for k, v in theirs.items()), name


def test_killed_on_2_and_resumed_on_3_within_1e_5(outs):
    whole, resumed = outs["two"], outs["resumed_on_3"]
    assert _relative(_losses(resumed), _losses(whole)) <= 1e-5
    for name in ["model", "ema"]:
        _close_but_the_key_bias(saved_weights(resumed, name), saved_weights(whole, name), f"{name}.pt")


def test_ema_pt_is_the_emas_average_as_diffusers_writes_it_and_loads_into_a_fresh_unet(outs):
    out = outs["rerun_on_2"]
    ema, model = saved_weights(out, "ema"), saved_weights(out, "model")
    # diffusers' way: ema.copy_to(unet.parameters()) and save_pretrained, done by the script after the run
    diffusers_ema = load_file(out / "unet-ema" / "diffusion_pytorch_model.safetensors")
    assert ema.keys() == diffusers_ema.keys() == model.keys()
    assert all(torch.equal(ema[k], v) for k, v in diffusers_ema.items())
    # An average, not the weights: after 12 steps of warm-up its decay is 1 - 12**-0.75, ~0.85.
    assert all(not torch.equal(ema[k], model[k]) for k in model)
    fresh = UNet2DModel.from_config(UNet2DModel.load_config(out / "unet-ema"))
    fresh.load_state_dict(ema)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in ema.items())
