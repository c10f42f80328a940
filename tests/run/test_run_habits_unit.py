"""The single-device habits of tests/run/test_run_habits.py, one by one, in a world of one (fast)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import Dataset, TensorDataset
from tqdm import tqdm

import ddpkit
from ddpkit.run.data.map_source import EpochIndices
from ddpkit.run.invariant.seeding import SeededFetch


class Jitter(Dataset):
    """A sample plus noise from all three global generators, drawn in __getitem__."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i + random.random(), np.random.rand(), torch.rand(()).item()])


def _indices(values: list[int], epoch: int) -> EpochIndices:
    indices = EpochIndices(values)
    indices.epoch = epoch
    return indices


def test_a_sample_draws_the_same_whatever_batch_fetches_it():
    fetch = SeededFetch(Jitter(), seed=3)
    together = fetch.__getitems__(_indices([4, 7, 1], epoch=0))
    alone = [fetch.__getitems__(_indices([i], epoch=0))[0] for i in (4, 7, 1)]
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    assert not torch.equal(fetch.__getitems__(_indices([4], epoch=1))[0], together[0])  # a new epoch


def test_fetching_leaves_the_training_process_generators_alone():
    fetch = SeededFetch(Jitter(), seed=3)
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    fetch.__getitems__(_indices([0, 1], epoch=0))
    assert torch.equal(torch.rand(3), expected)  # dropout after a batch draws what it would have


def test_a_dataset_that_draws_nothing_is_not_reseeded():
    fetch = SeededFetch(_Fixed(), seed=0)
    fetch.__getitems__(_indices([0, 1], epoch=0))
    assert fetch.drawn == set() and not fetch.plain  # watched, in case a later sample draws
    tensors = TensorDataset(torch.arange(6.0))
    assert SeededFetch(torch.utils.data.Subset(tensors, [1, 2]), seed=0).plain  # torch's cannot draw


class _Fixed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(float(i))


class _Augmented(TensorDataset):
    def __getitem__(self, i: int) -> tuple:
        return (self.tensors[0][i] + torch.rand(()),)


def test_a_subclass_of_a_dataset_that_draws_nothing_is_watched():
    fetch = SeededFetch(_Augmented(torch.arange(6.0)), seed=0)
    together = fetch.__getitems__(_indices([1, 2], epoch=0))
    assert not fetch.plain and fetch.drawn == {"torch"}
    assert torch.equal(
        together[1][0], SeededFetch(_Augmented(torch.arange(6.0)), 0).__getitems__(_indices([2], 0))[0][0]
    )


class RareDraw(torch.utils.data.Dataset):
    """Draws from numpy's global generator for one sample in ten, and from a generator of its own
    for every sample."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        rare = np.random.rand() if i == 7 else 0.0
        return torch.tensor([i, self.rng.random(), rare])


def test_a_draw_that_comes_rarely_is_seeded_and_its_batch_fetched_again():
    fetch = SeededFetch(RareDraw(), seed=3)
    first = fetch.__getitems__(_indices([4, 5], epoch=0))
    assert fetch.drawn == {"rng"}  # numpy's global generator is not seeded before it is drawn from
    together = fetch.__getitems__(_indices([4, 7, 1], epoch=0))
    assert fetch.drawn == {"rng", "numpy"}
    alone = SeededFetch(RareDraw(), seed=3)
    assert torch.equal(alone.__getitems__(_indices([7], epoch=0))[0], together[1])  # a fresh copy agrees
    assert torch.equal(first[0], together[0])


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(20, 6, generator=gen), torch.randn(20, 2, generator=gen))


def _train_with_own_clip(out, micro_batch: int | None) -> dict:
    run = ddpkit.Run(out=out, global_batch=8, micro_batch=micro_batch, progress=False, log_every=1)
    torch.manual_seed(3)
    model = run.setup(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    run.track(optimizer)
    loader = run.loader(_data())
    norms = []
    for _epoch in range(loader.epoch, 2):
        for x, y in loader:
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)))
            optimizer.step()
    weights = {k: v.clone() for k, v in model.module.state_dict().items()}
    run.finish()
    return {"weights": weights, "norms": norms}


def test_own_clip_with_micro_batches_is_the_update_without(tmp_path):
    whole, micro = (_train_with_own_clip(tmp_path / str(m), m) for m in (None, 2))
    for key, value in whole["weights"].items():
        torch.testing.assert_close(micro["weights"][key], value, rtol=1e-6, atol=1e-7)
    # Earlier micro-batches see no gradient (norm 0); a step's last sees the whole step's.
    assert [n for n in micro["norms"] if n > 0] == pytest.approx(whole["norms"], rel=1e-5)
    assert min(whole["norms"]) > 0.01  # the clip really clipped


def test_len_is_the_steps_of_an_epoch_at_every_point(tmp_path):
    run = ddpkit.Run(out=tmp_path, global_batch=8, micro_batch=2, progress=False)
    run.setup(nn.Linear(6, 2))
    loader = run.loader(_data())
    assert len(loader) == loader.steps_per_epoch == 3  # 8 + 8 + 4; micro-batches are 10
    loader.load_state_dict({**loader.state_dict(), "consumed": 16})  # what a resume mid-epoch does
    assert len(loader) == 3
    run.close()


def test_values_logged_between_steps_get_a_line_of_their_own(tmp_path):
    run = ddpkit.Run(out=tmp_path, global_batch=10, progress=False, log_every=1, save_every=0)
    model = run.setup(nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    loader = run.loader(_data())
    for epoch in range(loader.epoch, 3):
        for x, y in loader:
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()
            run.log(in_step=1.0 + run.step)  # averaged into the step's line
        run.log(val=float(epoch))
        run.log(val=float(epoch) + 0.5)  # twice between the same steps: their mean, once
        if epoch == 1:
            run.save()  # the value is written before the checkpoint, not dropped
    run.finish()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["val"]) for line in lines if "val" in line] == [
        (2, 0.25),
        (4, 1.25),
        (6, 2.25),
    ]
    assert [line["in_step"] for line in lines if "loss" in line] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert [line["step"] for line in lines] == [1, 2, 2, 3, 4, 4, 5, 6, 6]  # each after its step's line


def test_one_progress_bar_with_the_epochs_total(tmp_path, capsys):
    run = ddpkit.Run(out=tmp_path, global_batch=8, progress=True)
    model = run.setup(nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    loader = run.loader(_data())
    for _ in loader:
        pass
    bar = run._monitor.bar
    run.finish()
    assert (bar.desc.startswith("epoch 0"), bar.total, bar.n) == (True, 3, 3)
    assert "epoch 0: 100%" in capsys.readouterr().err


def _frames_until(tmp_path, stop_at: int | None) -> list[dict]:
    """Two epochs of 3 steps, checkpointed every step; each batch's progress-bar frame."""
    run = ddpkit.Run(out=tmp_path, global_batch=8, save_every=1, progress=True)
    run.track(torch.optim.SGD(run.setup(nn.Linear(6, 2)).parameters(), lr=0.1))
    loader, frames = run.loader(_data()), []
    try:
        for _ in range(loader.epoch, 2):
            for _ in loader:
                frames.append(dict(run._monitor.bar.format_dict))
                if run.step == stop_at:
                    return frames  # left in this step, as by a kill: resumed from the one before
    finally:
        run.close()
    return frames


def test_a_resumed_runs_bar_counts_from_where_it_resumed_with_a_rate_of_its_own(tmp_path):
    # After a resume the first frame once showed a negative rate: (epoch steps - the run's step) / t.
    _frames_until(tmp_path, stop_at=5)
    frames = _frames_until(tmp_path, stop_at=None)  # resumed at step 4, epoch 1's first
    assert (frames[0]["initial"], frames[0]["n"], frames[0]["total"]) == (1, 1, 3)
    assert all(f["n"] - f["initial"] >= 0 and (f["rate"] or 0) >= 0 for f in frames), frames


def test_the_users_own_bar_turns_ddpkits_off(tmp_path):
    run = ddpkit.Run(out=tmp_path, global_batch=8, progress=True)
    run.setup(nn.Linear(6, 2))
    loader = run.loader(_data())
    with tqdm(total=len(loader)) as own:
        for _ in loader:
            own.update(1)
        assert run._monitor.bar.disable
    run.finish()


def test_optimizer_step_hooks_run_once_a_step_after_the_real_step(tmp_path):
    """A loop's step hooks (an EMA in a post hook, a counter in a pre hook, torch's global ones)
    run once per optimizer step, as on one device: not at the micro-batches the run accumulates,
    and not twice at the step's last (once for the run's gate, once for the optimizer's own),
    also once a resume has loaded the optimizer's state (load_state_dict hooks its class again)."""
    assert _hooks_seen(tmp_path, steps=3) == ["pre", "post True", "global"] * 3  # 3 steps of 4 micro-batches
    assert _hooks_seen(tmp_path, steps=5) == ["pre", "post True", "global"] * 2  # resumed at step 3


def _hooks_seen(out: Path, steps: int) -> list[str]:
    run = ddpkit.Run(out=out, global_batch=8, micro_batch=2, progress=False, steps=steps, save_every=1)
    model = run.setup(nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    seen: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: seen.append("pre"))
    optimizer.register_step_post_hook(lambda opt, *_: seen.append(f"post {bool(opt.state)}"))
    handle = register_optimizer_step_post_hook(lambda *_: seen.append("global"))
    run.track(optimizer)
    data = TensorDataset(torch.randn(48, 3, generator=torch.Generator().manual_seed(0)), torch.randn(48, 1))
    try:
        for x, y in run.loader(data):
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()
    finally:
        handle.remove()
    run.finish()
    return seen
