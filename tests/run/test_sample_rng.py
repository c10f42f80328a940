"""Per-sample seeding through the libraries' public APIs (run/invariant/seeding.py) and its fast path,
``ddpkit.sample_rng()`` (run/invariant/sample_rng.py): the same draws whatever batch, worker or thread
fetches a sample, and the training process's generators left exactly as they were."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

import ddpkit
from ddpkit.run.data.map_source import EpochIndices
from ddpkit.run.invariant.sample_rng import SampleRng, pcg64_seeder
from ddpkit.run.invariant.seeding import SeededFetch, declared_draws


def _indices(values: list[int], epoch: int = 0) -> EpochIndices:
    indices = EpochIndices(values)
    indices.epoch = epoch
    return indices


class Ported(Dataset):
    """Draws from all three of the sample's generators, and from nothing else."""

    draws_random = "sample_rng"

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        rng = ddpkit.sample_rng()
        draws = [rng.numpy.random(), rng.python.random(), torch.rand((), generator=rng.torch).item()]
        return torch.tensor([float(i), *draws, rng.numpy.random()])  # the second numpy draw goes on


class Mixed(Dataset):
    """A dataset half ported: sample_rng() for the crop, torch's global generator for the flip."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([ddpkit.sample_rng().numpy.random(), torch.rand(()).item()])


def _globals() -> tuple:
    return random.getstate(), repr(np.random.get_state(legacy=False)), torch.get_rng_state()


def _same_globals(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_a_ported_dataset_draws_per_sample_and_moves_no_global_generator():
    fetch = SeededFetch(Ported(), seed=3)
    before = _globals()
    together = fetch.__getitems__(_indices([4, 7, 1, 7]))
    assert _same_globals(_globals(), before) and fetch.drawn == set()
    alone = [fetch.__getitems__(_indices([i]))[0] for i in (4, 7, 1, 7)]
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    assert torch.equal(together[1], together[3])  # an index twice in a batch is seeded twice
    assert len({tuple(t[1:].tolist()) for t in together[:3]}) == 3
    assert together[0][1] != together[0][4]  # within a sample, a generator draws on
    assert not torch.equal(fetch.__getitems__(_indices([4], epoch=1))[0], together[0])


def test_sample_rng_outside_a_fetch_is_one_line():
    with pytest.raises(ddpkit.ConfigError, match=r"^ddpkit.sample_rng\(\) is for a Dataset's __getitem__"):
        ddpkit.sample_rng()
    with pytest.raises(ddpkit.ConfigError):
        Ported()[0]  # a plain DataLoader's fetch, say
    kept = SeededFetch(Keeps(), seed=0).__getitems__(_indices([0]))
    with pytest.raises(ddpkit.ConfigError):
        _ = kept[0].numpy  # kept past its sample


class Keeps(Dataset):
    draws_random = "sample_rng"

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> SampleRng:
        return ddpkit.sample_rng()


def test_a_half_ported_dataset_is_still_watched_and_seeded():
    fetch = SeededFetch(Mixed(), seed=3)
    together = fetch.__getitems__(_indices([2, 5]))
    assert fetch.drawn == {"torch"}
    assert torch.equal(together[1], SeededFetch(Mixed(), seed=3).__getitems__(_indices([5]))[0])


def test_what_a_dataset_says_it_draws_from():
    assert declared_draws(Ported()) == "sample_rng"
    assert declared_draws(Subset(Ported(), [1, 2])) == "sample_rng"
    assert (
        declared_draws(ConcatDataset([Ported(), torch.utils.data.TensorDataset(torch.ones(2))]))
        == "sample_rng"
    )
    assert declared_draws(ConcatDataset([Ported(), Mixed()])) is True
    assert declared_draws(type("Subclass", (Ported,), {})()) is True  # a subclass may add a transform
    wrong = type("Wrong", (Ported,), {"draws_random": "numpy"})()
    with pytest.raises(
        ddpkit.ConfigError, match="Wrong.draws_random = 'numpy': use True, False or 'sample_rng'"
    ):
        SeededFetch(wrong, seed=0)


class NumpyGlobal(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), np.random.standard_normal()])


@pytest.mark.parametrize("draws", [True, False])
def test_numpys_global_and_its_cached_gaussian_are_left_as_they_were(draws):
    # numpy's global is swapped for a stand-in while a batch is fetched, which clears its cached
    # gaussian: the training process's is set back.
    fetch = SeededFetch(NumpyGlobal() if draws else Mixed(), seed=1)
    np.random.seed(5)
    np.random.standard_normal()  # two made, one cached
    before = np.random.get_state(legacy=False)
    assert before["has_gauss"] == 1
    fetch.__getitems__(_indices([0, 3]))
    after = np.random.get_state(legacy=False)
    assert repr(after) == repr(before) and ("numpy" in fetch.drawn) == draws


def test_a_global_draw_in_one_sample_in_ten_is_seen_whatever_came_before():
    # python's generator is watched from a known state and numpy's through a stand-in: neither
    # may miss a draw because the previous batch left it somewhere.
    class Rare(Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([random.random() if i == 7 else 0.0, np.random.rand() if i == 7 else 0.0])

    fetch = SeededFetch(Rare(), seed=2)
    for start in range(0, 6, 2):
        fetch.__getitems__(_indices([start, start + 1]))
    assert fetch.drawn == set()
    late = fetch.__getitems__(_indices([6, 7]))
    assert fetch.drawn == {"random", "numpy"}
    assert torch.equal(late[1], SeededFetch(Rare(), seed=2).__getitems__(_indices([7]))[0])


class _Batches:
    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(_indices(b) for b in self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class Everything(Dataset):
    """Draws from the globals, a generator of its own and the sample's."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        rng = ddpkit.sample_rng()
        draws = [random.random(), np.random.rand(), torch.rand(()).item(), self.rng.random()]
        return torch.tensor([float(i), *draws, rng.numpy.random(), rng.python.random()])


@pytest.mark.parametrize("dataset", [Everything, Ported])
def test_workers_and_threads_draw_what_the_training_process_draws(dataset):
    alone = torch.stack(SeededFetch(dataset(), seed=4).__getitems__(_indices(list(range(12)))))
    batches = [[3, 0, 7], [11, 1, 2], [4, 5, 6, 8], [9, 10]]
    loader = DataLoader(
        SeededFetch(dataset(), seed=4), batch_sampler=_Batches(batches), num_workers=2, collate_fn=torch.stack
    )
    order = [i for b in batches for i in b]
    assert torch.equal(torch.cat(list(loader)), alone[order])
    fetch, results = SeededFetch(dataset(), seed=4), {}

    def fetch_in_thread(k: int) -> None:
        results[k] = torch.stack(fetch.__getitems__(_indices(batches[k])))

    threads = [threading.Thread(target=fetch_in_thread, args=(k,)) for k in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The sample's generators are each thread's own; batches that seed the globals take turns.
    assert torch.equal(torch.cat([results[k] for k in range(len(batches))]), alone[order])


def test_the_pcg64_seed_is_a_state_the_property_accepts_and_clears_the_cached_half_word():
    g = np.random.default_rng(0)
    g.integers(0, 10, dtype=np.uint32)  # leaves a cached half-word
    assert g.bit_generator.state["has_uint32"] == 1
    pcg64_seeder(g.bit_generator)(0x1234_5678_9ABC_DEF0)
    state = g.bit_generator.state
    assert state["has_uint32"] == 0 and state["state"]["inc"] % 2 == 1
    first = g.random()
    pcg64_seeder(g.bit_generator)(0x1234_5678_9ABC_DEF0)
    assert g.random() == first
