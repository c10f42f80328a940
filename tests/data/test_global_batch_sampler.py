"""GlobalBatchSampler: every sample once per epoch, the same order at any world size, exact resume."""

from __future__ import annotations

import pytest

from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.errors import ConfigError


def _samplers(world_size: int, n: int = 23, batch: int = 6, **kw) -> list[GlobalBatchSampler]:
    return [GlobalBatchSampler(n, batch, r, world_size, seed=7, **kw) for r in range(world_size)]


def _epoch_of_rank_indices(world_size: int, n: int = 23, batch: int = 6) -> list[list[list[int]]]:
    samplers = _samplers(world_size, n, batch)
    steps = []
    for _ in range(samplers[0].steps_per_epoch):
        steps.append([s.rank_slice(s.next_global_batch()) for s in samplers])
    return steps


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_each_sample_exactly_once_per_epoch(world_size):
    taken = [i for step in _epoch_of_rank_indices(world_size) for share in step for i in share]
    assert sorted(taken) == list(range(23))


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_global_batches_do_not_depend_on_world_size(world_size):
    single = [sum(step, []) for step in _epoch_of_rank_indices(1)]
    many = [sum(step, []) for step in _epoch_of_rank_indices(world_size)]
    assert many == single


def test_shares_differ_by_at_most_one_and_last_batch_is_partial():
    steps = _epoch_of_rank_indices(4)  # 23 = 3 * 6 + 5
    assert [len(share) for share in steps[-1]] == [2, 1, 1, 1]
    assert all(len(share) in (1, 2) for step in steps for share in step)


def test_next_epoch_reshuffles_deterministically():
    a, b = GlobalBatchSampler(10, 10, 0, 1, seed=1), GlobalBatchSampler(10, 10, 0, 1, seed=1)
    first, second = a.next_global_batch(), a.next_global_batch()
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert b.next_global_batch() == first and b.next_global_batch() == second
    assert a.state_dict()["epoch"] == 1


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_resume_at_another_world_size_continues_with_the_same_samples(before, after):
    reference = GlobalBatchSampler(50, 8, 0, 1, seed=7)
    expected = [reference.next_global_batch() for _ in range(12)]  # crosses an epoch boundary
    old = _samplers(before, n=50, batch=8)
    for _ in range(5):
        for s in old:
            s.next_global_batch()
    new = _samplers(after, n=50, batch=8)
    for s in new:
        s.load_state_dict(old[0].state_dict())
    resumed = [[s.rank_slice(s.next_global_batch()) for s in new] for _ in range(7)]
    assert [sum(step, []) for step in resumed] == expected[5:]


def test_drop_last_skips_the_partial_batch():
    s = GlobalBatchSampler(10, 4, 0, 1, seed=0, drop_last=True)
    assert s.steps_per_epoch == 2
    s.next_global_batch(), s.next_global_batch()
    s.next_global_batch()
    assert s.state_dict()["epoch"] == 1


def test_state_from_another_dataset_is_refused():
    s = GlobalBatchSampler(10, 4, 0, 1, seed=0)
    with pytest.raises(ConfigError, match="num_samples=12 but this run has num_samples=10"):
        s.load_state_dict({"epoch": 0, "consumed": 4, "seed": 0, "num_samples": 12})
