"""Random transforms in a dataset, seeded per sample: the same draws at any world size.

A single-device script's augmentation (a random flip in ``__getitem__``) draws from the global
generators of whichever process fetches the sample. Under data parallelism that process, its
position in its stream and the other samples of its batch all depend on the world size and the
micro-batch, so the draws would too. ``SeededFetch`` seeds python, numpy and torch's CPU
generator from (run seed, epoch, sample index) before each sample instead.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info


def seed_everything(seed: int) -> None:
    """The same seed on every rank: identical model init, so the engine's broadcast changes nothing."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's random transforms: (run seed, epoch, sample index) alone."""
    digest = hashlib.blake2b(repr((seed, epoch, index)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_PCG_MULT, _PCG_INC = 0x9E3779B97F4A7C15F39CC0605CEDC835, 0xDA942042E4DD58B5C4C2F5D8E9D6A3B1  # odd 128-bit

GENERATOR_TYPES = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)


def owned_generators(dataset: Dataset) -> dict[str, Any]:
    """The generators a dataset holds as attributes (``self.rng = np.random.default_rng()``): its
    draws come from them, not from the global ones, so they are seeded per sample too."""
    found = {name: value for name, value in vars(dataset).items() if isinstance(value, GENERATOR_TYPES)}
    return {
        name: g for name, g in found.items() if not isinstance(g, torch.Generator) or g.device.type == "cpu"
    }


def _get_state(g: Any) -> Any:
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    return g.getstate() if isinstance(g, random.Random) else g.get_state()


def _set_state(g: Any, state: Any) -> None:
    if isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    elif isinstance(g, random.Random):
        g.setstate(state)
    else:
        g.set_state(state)


def _seed(g: Any, seed: int) -> None:
    if isinstance(g, np.random.Generator) and isinstance(g.bit_generator, np.random.PCG64):
        # numpy's default: its state set in place from the (already hashed) seed, 1.8 us against
        # 9.7 us for a new PCG64(seed) and its SeedSequence; the increment must be odd.
        state = {"state": seed * _PCG_MULT % 2**128, "inc": seed * _PCG_INC % 2**128 | 1}
        g.bit_generator.state = {"bit_generator": "PCG64", "state": state, "has_uint32": 0, "uinteger": 0}
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = type(g.bit_generator)(seed).state
    elif isinstance(g, np.random.RandomState):
        g.seed(seed % 2**32)
    elif isinstance(g, torch.Generator):
        g.manual_seed(seed)
    else:
        g.seed(seed)


def _rng_states(owned: dict[str, Any]) -> tuple:
    own = {name: _get_state(g) for name, g in owned.items()}
    return random.getstate(), np.random.get_state(), torch.default_generator.get_state(), own


def _set_rng_states(states: tuple, owned: dict[str, Any]) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.default_generator.set_state(states[2])
    for name, g in owned.items():
        _set_state(g, states[3][name])


def _same_states(a: tuple, b: tuple) -> bool:
    return (
        a[0] == b[0]
        and a[1][2:] == b[1][2:]
        and np.array_equal(a[1][1], b[1][1])
        and torch.equal(a[2], b[2])
        and _same(a[3], b[3])  # the owned generators' states
    )


def _same(a: Any, b: Any) -> bool:
    """Equal generator states: dicts, tuples and lists of numbers, arrays and tensors, compared
    whole (a repr would elide the middle of a long state)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class SeededFetch(Dataset):
    """Wraps the user's dataset so that random transforms draw the same numbers for the same sample
    at any world size, any micro_batch and after a resume.

    Before each sample is fetched, python, numpy and torch's CPU generator are seeded from (run
    seed, epoch, sample index), and so is every generator the dataset holds as an attribute
    (numpy ``Generator``/``RandomState``, ``random.Random``, a CPU ``torch.Generator``): which
    rank, worker or micro-batch fetches a sample no longer matters. In the training process
    (num_workers=0) the generators are put back afterwards, so
    the model's own draws (dropout) are what they would be without data loading. Seeding costs
    about 8 us a sample and 3 us more per generator the dataset holds (2026-11-27, this 2-core
    CPU), so the first micro-batch of each epoch is fetched plainly to see whether
    the dataset draws at all; one that does not (a TensorDataset) is not seeded that epoch.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.draws: bool | None = None  # whether the dataset draws random numbers; None: not known yet
        self.owned = owned_generators(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list:
        if self.draws is False:
            return self._plain(indices)
        before = _rng_states(self.owned)
        in_worker = get_worker_info() is not None
        try:
            if self.draws is None:
                batch = self._plain(indices)
                self.draws = not _same_states(before, _rng_states(self.owned))
                if not self.draws:
                    return batch
            return [self._seeded(getattr(indices, "epoch", 0), index) for index in indices]
        finally:
            if not in_worker:  # a worker's generators are its own; the training process's are the run's
                _set_rng_states(before, self.owned)

    def _plain(self, indices: list[int]) -> list:
        own = getattr(self.dataset, "__getitems__", None)
        return own(indices) if own else [self.dataset[i] for i in indices]

    def _seeded(self, epoch: int, index: int) -> Any:
        seed = sample_seed(self.seed, epoch, index)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        # The CPU generator alone: all a transform in a worker can draw from (a worker cannot use
        # CUDA), and torch.manual_seed's visit to every other backend costs ~0.2 ms.
        torch.default_generator.manual_seed(seed)
        for number, g in enumerate(self.owned.values(), start=1):  # each its own stream
            _seed(g, sample_seed(seed, number, index))
        return self.dataset[index]
