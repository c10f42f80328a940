"""``run.loader(DataLoader(...))`` keeps every setting of the DataLoader, or refuses it in one line.

Each test builds a world of one (``ddpkit.Run`` without a launcher) and compares the loader's
batches with those of the plain torch DataLoader: the same batches in the same order, where the
setting has a meaning in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    SequentialSampler,
    TensorDataset,
    get_worker_info,
)

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.launch.start_method import FORKSERVER
from ddpkit.run.data.from_dataloader import batch_size_line

DATA = TensorDataset(torch.arange(50.0), torch.arange(50) % 3)  # sample i: (i, i mod 3)


def _batches(data: Dataset | DataLoader, **options) -> list:
    """Every batch of one epoch of ``run.loader(data)`` in a fresh world of one."""
    with ddpkit.Run(progress=False, **options) as run:
        return list(run.loader(data))


def _same(a, b) -> bool:
    """Batches equal in structure, types and values (tensors exactly)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _same_batches(ours: list, torchs: list) -> bool:
    return len(ours) == len(torchs) and all(map(_same, ours, torchs))


def _first_column(batches: list) -> list[int]:
    return [int(v) for x, _ in batches for v in x]


def test_without_shuffle_the_batches_are_the_dataloaders_in_order():
    loader = DataLoader(DATA, batch_size=8)
    ours = _batches(loader)
    assert _same_batches(ours, list(loader))
    assert _first_column(ours) == list(range(50))


def test_drop_last_drops_the_last_partial_global_batch():
    loader = DataLoader(DATA, batch_size=8, drop_last=True)
    with ddpkit.Run(progress=False) as run:
        ours = run.loader(loader)
        assert len(ours) == 6
        batches = list(ours)
    assert len(batches) == 6 and _same_batches(batches, list(loader))
    assert len(_batches(DataLoader(DATA, batch_size=8), drop_last=False)) == 7  # the Run agrees


@pytest.mark.parametrize("name", ["drop_last", "shuffle"])
def test_a_run_setting_that_contradicts_the_dataloader_is_refused(name):
    loader = DataLoader(DATA, batch_size=8, **{name: True})
    with pytest.raises(ConfigError, match=rf"ddpkit.Run\({name}=False\) but the DataLoader .* {name}=True"):
        _batches(loader, **{name: False})


def _pairs(samples: list) -> dict:
    """The samples and their labels as one dict batch (a collate_fn of the user's)."""
    return {"x": torch.stack([x for x, _ in samples]), "labels": [int(y) for _, y in samples]}


def test_the_collate_fn_makes_the_batches():
    loader = DataLoader(DATA, batch_size=8, collate_fn=_pairs)
    ours = _batches(loader)
    assert isinstance(ours[0], dict) and ours[0]["labels"] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert _same_batches(ours, list(loader))


def _init(worker_id: int) -> None:
    get_worker_info().dataset.open()  # the user's dataset, as in a plain DataLoader's worker


class _Opened(Dataset):
    """Samples (i, 1 once a worker opened it, else 0): tells whether worker_init_fn ran."""

    def __init__(self) -> None:
        self.opened = 0

    def open(self) -> None:
        self.opened = 1

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, self.opened])


def test_the_loading_settings_are_carried_over():
    settings = dict(
        num_workers=2,
        collate_fn=_pairs,
        pin_memory=True,
        timeout=30.0,
        worker_init_fn=_init,
        multiprocessing_context="fork",
        persistent_workers=True,
        prefetch_factor=3,
        pin_memory_device="cpu",
    )
    loader = DataLoader(DATA, batch_size=8, **settings)
    with ddpkit.Run(progress=False) as run:  # no batch is drawn: no worker starts
        built = run.loader(loader).dataloader
    for name in settings:
        assert getattr(built, name) == getattr(loader, name), name


def test_worker_init_fn_runs_in_the_workers_with_the_users_dataset():
    loader = DataLoader(_Opened(), batch_size=3, num_workers=1, worker_init_fn=_init)
    ours = _batches(loader)
    assert [row.tolist() for batch in ours for row in batch] == [[i, 1] for i in range(6)]
    assert _same_batches(ours, list(loader))


def test_in_order_false_and_a_negative_timeout_are_refused():
    with pytest.raises(ConfigError, match=r"in_order=False .* leave in_order=True"):
        _batches(DataLoader(DATA, batch_size=8, in_order=False))
    with ddpkit.Run(progress=False, global_batch=8) as run:
        with pytest.raises(ConfigError, match=r"timeout=-1 is below 0"):
            run.loader(DATA, timeout=-1)


_DATASETS: dict[str, Callable[[], object]] = {
    "list of tensors": lambda: [torch.tensor([i, 2.0 * i]) for i in range(7)],
    "tuple of (x, y)": lambda: tuple((torch.tensor([float(i)]), i % 2) for i in range(7)),
    "dict keyed 0..n-1": lambda: {i: torch.tensor(i) for i in range(7)},
    "list of dicts": lambda: [{"x": torch.tensor([i, i]), "label": i % 3} for i in range(7)],
}


@pytest.mark.parametrize("kind", _DATASETS)
def test_plain_python_datasets_work_through_a_dataloader_and_bare(kind):
    data = _DATASETS[kind]()
    torchs = list(DataLoader(data, batch_size=3))
    assert _same_batches(_batches(DataLoader(data, batch_size=3)), torchs)
    assert _same_batches(_batches(data, global_batch=3, shuffle=False), torchs)


def test_the_batch_size_is_said_once_to_be_the_global_batch(caplog):
    logger = logging.getLogger("ddpkit")
    with ddpkit.Run(progress=False, micro_batch=4) as run:
        logger.addHandler(caplog.handler)  # the run's logger does not propagate to pytest's
        try:
            list(run.loader(DataLoader(DATA, batch_size=8)))
        finally:
            logger.removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records if "batch_size" in r.getMessage()]
    assert said == [batch_size_line(8, 1, 4)]
    assert said[0] == (
        "the DataLoader's batch_size=8 is the global batch (samples per optimizer step over the 1 "
        "process): 8 a process, in micro-batches of 4; for 8 a process, give ddpkit.Run(global_batch=8)"
    )
    assert batch_size_line(12, 2, None) == (
        "the DataLoader's batch_size=12 is the global batch (samples per optimizer step over all 2 "
        "processes): 6 a process, in micro-batches of 6; for 12 a process, give "
        "ddpkit.Run(global_batch=24)"
    )


def test_the_batch_size_line_is_not_said_when_the_run_sets_the_global_batch(caplog):
    logger = logging.getLogger("ddpkit")
    with ddpkit.Run(progress=False, global_batch=16) as run:
        logger.addHandler(caplog.handler)
        try:
            assert len(run.loader(DataLoader(DATA, batch_size=8))) == 4  # the run's 16, not 8
        finally:
            logger.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if "batch_size" in r.getMessage()]


def test_no_automatic_batching_and_a_batch_sampler_are_refused():
    with pytest.raises(ConfigError, match=r"batch_size=None \(no automatic batching"):
        _batches(DataLoader(DATA, batch_size=None))
    own = BatchSampler(SequentialSampler(DATA), 8, drop_last=False)
    with pytest.raises(ConfigError, match=r"replaces the DataLoader's batch_sampler \(BatchSampler\)"):
        _batches(DataLoader(DATA, batch_sampler=own))


def test_a_generator_seeded_as_the_run_is_taken_another_is_refused():
    seeded = DataLoader(DATA, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    plain = DataLoader(DATA, batch_size=8, shuffle=True)
    assert _same_batches(_batches(seeded, seed=3), _batches(plain, seed=3))
    with pytest.raises(ConfigError, match=r"generator has seed 3, .* give ddpkit.Run\(seed=3\)"):
        _batches(seeded, seed=0)


def test_shuffle_draws_one_permutation_per_seed():
    loader = DataLoader(DATA, batch_size=8, shuffle=True)
    first, again, other = (_first_column(_batches(loader, seed=s)) for s in (1, 1, 2))
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert again == first and other != first
    assert _first_column(_batches(DATA, global_batch=8, seed=1)) == first  # a bare dataset shuffles too


def test_sync_batchnorm_on_a_cpu_names_what_to_use_instead():
    with ddpkit.Run(progress=False, sync_batchnorm=True) as run:
        with pytest.raises(ConfigError, match=r"GroupNorm or LayerNorm .*model.eval\(\) on the BN modules"):
            run.setup(nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4)))


class _Said(logging.Handler):
    """Keeps the messages of the ddpkit log lines a rank writes."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _on_each_rank() -> tuple[int, list[str], list[int]]:
    said = _Said()
    with ddpkit.Run(progress=False) as run:
        logging.getLogger("ddpkit").addHandler(said)
        loader = run.loader(DataLoader(DATA, batch_size=8, drop_last=True))
        seen = [int(v) for x, _ in loader for v in x]
    return len(loader), [m for m in said.messages if "batch_size" in m], seen


@pytest.mark.slow
def test_on_two_processes_rank_0_says_the_batch_size_once_and_each_rank_takes_half():
    (steps0, said0, seen0), (steps1, said1, seen1) = ddpkit.launch(_on_each_rank, 2, start_method=FORKSERVER)
    assert said0 == [batch_size_line(8, 2, None)] and said1 == []
    assert steps0 == steps1 == 6  # 50 samples, global batch 8, drop_last: 48 of them
    assert seen0 == [8 * step + i for step in range(6) for i in range(4)]
    assert seen1 == [8 * step + 4 + i for step in range(6) for i in range(4)]
