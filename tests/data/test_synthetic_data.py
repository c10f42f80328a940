"""Tests for the synthetic ToyDataset: determinism per seed and a learnable target."""

import pytest
import torch

from ddpkit.data.synthetic import ToyDataset


def test_same_seed_gives_identical_data():
    a, b = ToyDataset(64, seed=5), ToyDataset(64, seed=5)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)


def test_different_seeds_differ():
    assert not torch.equal(ToyDataset(64, seed=0).x, ToyDataset(64, seed=1).x)


def test_items_have_toy_model_shapes():
    ds = ToyDataset(num_samples=10)
    assert len(ds) == 10
    x, y = ds[3]
    assert x.shape == (10,) and y.shape == (5,)


def test_target_is_nearly_linear_in_input():
    ds = ToyDataset(512, seed=0)
    # A least-squares fit with a bias column leaves only the small noise behind.
    design = torch.cat([ds.x, torch.ones(len(ds), 1)], dim=1)
    solution = torch.linalg.lstsq(design, ds.y).solution
    residual = ds.y - design @ solution
    assert residual.std().item() < 0.02
    assert ds.y.std().item() > 0.3


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"num_samples": 0}, "num_samples"), ({"noise_std": -1.0}, "noise_std")]
)
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ToyDataset(**kwargs)
