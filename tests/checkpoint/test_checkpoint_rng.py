"""RNG capture and restore: the next draws repeat exactly, also after a save and a weights_only load."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ddpkit.checkpoint import capture_rng, load_checkpoint, restore_rng, save_checkpoint
from ddpkit.errors import ConfigError


def draw() -> dict:
    """Draws from every generator, including the Gaussian paths that cache a second value."""
    return {
        "python": [random.random(), random.gauss(0, 1), random.gauss(0, 1), random.randrange(10**9)],
        "numpy": np.concatenate([np.random.rand(3), np.random.randn(3), np.random.randint(0, 10**9, 3)]),
        "torch": torch.cat([torch.rand(3), torch.randn(3), torch.randint(0, 10**9, (3,)).double()]),
    }


def assert_draws_equal(a: dict, b: dict) -> None:
    assert a["python"] == b["python"]
    np.testing.assert_array_equal(a["numpy"], b["numpy"])
    assert torch.equal(a["torch"], b["torch"])


def leave_gaussians_cached() -> None:
    # An odd number of Box-Muller draws leaves the second value cached inside each generator;
    # the captured state must carry it, or the next draw after restore differs.
    random.gauss(0, 1)
    np.random.randn()


def test_restore_repeats_the_draws_after_capture():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    leave_gaussians_cached()
    state = capture_rng()
    expected = draw()
    draw()  # move every generator on, so a restore that does nothing fails
    restore_rng(state)
    assert_draws_equal(draw(), expected)


def test_restore_changes_the_draws():
    state = capture_rng()
    first = draw()
    restore_rng(state)
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    assert draw()["python"] != first["python"]


def test_round_trip_through_a_weights_only_checkpoint(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    leave_gaussians_cached()
    path = save_checkpoint(tmp_path, 1, {"rng": [capture_rng()]})
    expected = draw()
    draw()
    restore_rng(load_checkpoint(path)["rng"][0])  # load_checkpoint uses weights_only=True
    assert_draws_equal(draw(), expected)


def test_captured_state_holds_only_weights_only_types():
    allowed = (torch.Tensor, int, float, str, type(None))

    def walk(value, where):
        if isinstance(value, dict):
            for key, item in value.items():
                assert isinstance(key, str), where
                walk(item, f"{where}.{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")
        else:
            assert isinstance(value, allowed), f"{where} is a {type(value).__name__}"

    state = capture_rng()
    walk(state, "rng")
    assert set(state) == {"python", "numpy", "torch", "cuda"}
    assert state["torch"].dtype == torch.uint8


def test_restore_refuses_a_state_that_is_not_from_capture():
    with pytest.raises(ConfigError, match="lacks numpy, torch, cuda; pass one rank's dict from capture_rng"):
        restore_rng({"python": capture_rng()["python"]})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_generators_round_trip():
    state = capture_rng()
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(4, device="cuda")
    restore_rng(state)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
