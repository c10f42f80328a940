"""What a loop does at the edges of a step and an epoch, in a world of one (fast): validation and a
plateau scheduler after an epoch, early stopping's own counters, an EMA after optimizer.step(), the
user's own model attributes."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import ddpkit
from ddpkit.data.sampler import GlobalBatchSampler, weighted_order
from ddpkit.run.data.map_source import EpochIndices
from ddpkit.run.invariant.seeding import SeededFetch
from ddpkit.run.state import checkpoints


class Killed(Exception):
    """Stands in for a SIGKILL: the run leaves without its end."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)


def _indices(values: list[int], epoch: int) -> EpochIndices:
    indices = EpochIndices(values)
    indices.epoch = epoch
    return indices


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))


def _train(out, kill_at: int | str | None = None, epochs: int = 4, engine: str = "torch") -> dict:
    """4 steps an epoch; after each epoch a validation loss, a plateau scheduler, early stopping.
    The backbone is frozen before run.setup and unfrozen for epoch 1 on (fine-tuning's recipe)."""
    run = ddpkit.Run(out=out, global_batch=4, micro_batch=2, save_every=4, progress=False, engine=engine)
    net = Net()
    net.backbone.requires_grad_(False)
    model = run.setup(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    ema = AveragedModel(ddpkit.unwrap(model), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    loop = {"best": float("inf"), "bad_epochs": 0, "validations": 0}
    run.track(optimizer, plateau, ema=ema, loop=loop)
    loader = run.loader(_data())
    val_x, val_y = _data().tensors
    try:
        for epoch in range(loader.epoch, epochs):
            if epoch == 1:  # a run resumed at epoch 2 never runs this line: the checkpoint knows
                net.backbone.requires_grad_(True)
            for x, y in loader:
                optimizer.zero_grad()
                run.backward(F.mse_loss(model(x), y))
                optimizer.step()
                ema.update_parameters(model)
                if run.step == kill_at:
                    raise Killed
            with torch.no_grad():
                val = F.mse_loss(model(val_x), val_y).item() + 1.0 * (epoch == 1)  # epoch 1 worse
            plateau.step(val)
            if kill_at == f"epoch {epoch} end":  # inside the epoch-end code, half of it done
                raise Killed
            loop["validations"] += 1
            loop["best"], loop["bad_epochs"] = (
                min(loop["best"], val),
                0 if val < loop["best"] else loop["bad_epochs"] + 1,
            )
            if loop["bad_epochs"] > 1:
                break
    except Killed:
        run.close()
        return {}
    run.finish()
    return {
        "weights": {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()},
        "ema": {k: v.clone() for k, v in ema.state_dict().items()},
        "lr": optimizer.param_groups[0]["lr"],
        "loop": dict(loop),
        "n_averaged": int(ema.n_averaged),
    }


@pytest.mark.parametrize(
    ("kill_at", "engine"),
    [
        *((step, "torch") for step in range(5, 16)),
        *((f"epoch {e} end", "torch") for e in (1, 2)),
        (10, "native"),
    ],
)
def test_epoch_end_code_is_in_the_checkpoint_and_a_killed_run_resumes_bit_equal(tmp_path, kill_at, engine):
    # Killed in epoch 1, after the step-4 checkpoint: that checkpoint once held the state from
    # before epoch 0's validation (scheduler, loop counters), so the resumed run never ran it.
    # Killed in epoch 2: the rerun never unfreezes the backbone, the checkpoint's requires_grad does.
    # Killed at every step, and inside each epoch's end code (after the plateau scheduler stepped,
    # before the loop's counters did): the rerun runs each epoch's end exactly once.
    whole = _train(tmp_path / "whole", engine=engine)
    assert whole["weights"]["backbone.weight"].ne(Net().backbone.weight).any(), "the backbone never trained"
    assert _train(tmp_path / "cut", kill_at=kill_at, engine=engine) == {}
    resumed = _train(tmp_path / "cut", engine=engine)
    assert resumed["loop"] == whole["loop"] and resumed["loop"]["validations"] == 4
    assert resumed["lr"] == whole["lr"] == 0.05  # the plateau after epoch 1 halved it once
    for part in ("weights", "ema"):
        assert all(torch.equal(resumed[part][k], whole[part][k]) for k in whole[part]), part


@pytest.mark.parametrize("kill_at", [4, "epoch 0 end"])
def test_killed_before_its_first_checkpoint_the_rerun_is_one_line_and_nothing_is_overwritten(
    tmp_path, kill_at
):
    # Epoch 0's last step (4) is checkpointed at step 5's start, after epoch 0's end code.
    assert _train(tmp_path / "cut", kill_at=kill_at) == {}
    logged = (tmp_path / "cut" / "metrics.jsonl").read_bytes()
    with pytest.raises(
        ddpkit.ConfigError, match="already holds a run .metrics.jsonl.; it wrote no checkpoint"
    ):
        _train(tmp_path / "cut")
    assert (tmp_path / "cut" / "metrics.jsonl").read_bytes() == logged


def test_a_tracked_ema_takes_the_weights_once_per_optimizer_step(tmp_path):
    # 4 steps an epoch of 2 micro-batches each: 16 steps, not 32 micro-batch updates.
    assert _train(tmp_path / "run")["n_averaged"] == 16


def test_the_wrapped_model_gives_the_users_attributes_and_methods():
    for engine in ("torch", "native"):
        run = ddpkit.Run(engine=engine, progress=False)
        model = run.setup(Net())
        x = torch.randn(2, 4)
        assert model.backbone is ddpkit.unwrap(model).backbone
        assert torch.equal(model.features(x), ddpkit.unwrap(model).features(x))
        with pytest.raises(AttributeError, match="no attribute 'nothing'"):
            model.nothing  # noqa: B018
        run.finish()


class OwnGenerators(torch.utils.data.Dataset):
    """Augmentation drawn from the dataset's own generators, as a single-device script writes it."""

    def __init__(self) -> None:
        self.rng, self.py = np.random.default_rng(0), random.Random(1)
        self.legacy, self.torch_gen = np.random.RandomState(2), torch.Generator().manual_seed(3)

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        draws = [
            self.rng.random(),
            self.py.random(),
            self.legacy.rand(),
            torch.rand((), generator=self.torch_gen),
        ]
        return torch.tensor([float(i), *map(float, draws)])


def test_a_datasets_own_generators_draw_per_sample_whatever_fetches_it():
    # Its own numpy Generator once differed between 1 and 2 processes by 0.44: which batch, rank
    # and worker fetched a sample decided what it drew.
    dataset = OwnGenerators()
    fetch = SeededFetch(dataset, seed=3)
    before = (dataset.rng.bit_generator.state, dataset.py.getstate(), dataset.torch_gen.get_state())
    together = fetch.__getitems__(_indices([4, 7, 1], epoch=0))
    alone = [fetch.__getitems__(_indices([i], epoch=0))[0] for i in (1, 7, 4)][::-1]
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    assert len({tuple(t[1:].tolist()) for t in together}) == 3  # each sample its own draws
    assert not torch.equal(fetch.__getitems__(_indices([4], epoch=1))[0], together[0])  # a new epoch
    after = (dataset.rng.bit_generator.state, dataset.py.getstate(), dataset.torch_gen.get_state())
    assert repr(after) == repr(before)  # the training process's copies are left as they were


def _manual_accumulation(**options) -> int:
    """A single-device loop's own accumulation: loss / 2, a step every 2 batches."""
    run = ddpkit.Run(global_batch=4, progress=False, **options)
    model = run.setup(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    try:
        for i, (x, y) in enumerate(run.loader(_data())):
            run.backward(F.mse_loss(model(x), y) / 2)
            if i % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
    except ddpkit.ConfigError:
        run.close()  # what the one-line hook's exit does in a script
        raise
    steps = run.step
    run.finish()
    return steps


def test_a_loops_own_gradient_accumulation_is_one_line_at_its_first_step():
    # It ran and resumed 9.5e-2 off: a checkpoint fell between the two halves of a pair.
    with pytest.raises(ddpkit.ConfigError, match=r"^step 1 ended without optimizer.step\(\).*micro_batch="):
        _manual_accumulation()
    assert _manual_accumulation(allow_unstepped=True) == 4  # said to be deliberate: it runs


def test_weighted_sampling_draws_by_weight_from_seed_and_epoch_alone():
    # WeightedRandomSampler is refused (it would replace the global-batch sampler); weights= is its
    # replacement: each epoch's draw depends on (seed, epoch) alone, so every world size sees the
    # same global batches, and a resumed run continues the same draw.
    weights = torch.tensor([0.0, 1.0, 0.0, 3.0] * 4)
    drawn = {}
    for world in (1, 2, 3):
        samplers = [
            GlobalBatchSampler(16, 6, r, world, seed=7, order=weighted_order(weights, 16))
            for r in range(world)
        ]
        drawn[world] = [samplers[0].next_global_batch() for _ in range(3)]  # 6 + 6 + 4
        shares = [sorted(i for s in samplers for i in s.rank_slice(batch)) for batch in drawn[world]]
        assert shares == [sorted(batch) for batch in drawn[world]]  # the ranks split each batch
    assert drawn[1] == drawn[2] == drawn[3]
    counts = torch.bincount(torch.tensor(sum(drawn[1], [])), minlength=16)
    assert counts[weights == 0].sum() == 0  # a zero weight is never drawn
    run = ddpkit.Run(global_batch=4, progress=False)
    with pytest.raises(ddpkit.ConfigError, match=r"weights=sampler.weights"):
        run.loader(DataLoader(_data(), batch_size=4, sampler=WeightedRandomSampler(weights, 16)))
    loader = run.loader(_data(), weights=weights)
    assert len(loader) == 4
    run.finish()


def test_the_same_command_on_a_finished_run_does_nothing_and_says_so(tmp_path, capsys, monkeypatch):
    # It once resumed from the final checkpoint, trained on and overwrote model.pt, exit 0.
    first = _train(tmp_path / "run")
    model = tmp_path / "run" / "model.pt"
    written = model.read_bytes()
    monkeypatch.setattr(checkpoints, "this_process", lambda: -1)  # the same command in another process
    with pytest.raises(SystemExit) as done:
        _train(tmp_path / "run")
    assert done.value.code == 0
    assert "holds this command's finished run (step 16); nothing to do" in capsys.readouterr().out
    assert model.read_bytes() == written and first["loop"]["validations"] == 4
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--epochs", "5"])  # another command trains on
    assert _train(tmp_path / "run", epochs=5)["loop"]["validations"] == 5


@pytest.mark.parametrize("engine", ["torch", "native"])
@pytest.mark.parametrize("when", ["between two micro-batches", "all frozen"])
def test_requires_grad_changed_inside_a_step_or_to_nothing_is_one_line(engine, when):
    # Between steps the engine re-plans (above, and on 1/2/3 processes in test_run_habits); inside a
    # step the earlier micro-batches' gradients would lack the new parameters.
    run = ddpkit.Run(global_batch=4, micro_batch=2, engine=engine, progress=False)
    net = Net()
    model = run.setup(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    expected = (
        "backbone.weight' of Net changed in the middle of step 2"
        if when != "all frozen"
        else r"every parameter of model \(Net\) is frozen"
    )
    try:
        with pytest.raises(ddpkit.ConfigError, match=expected):
            for i, (x, y) in enumerate(run.loader(_data())):
                if i == 3 or (i == 2 and when == "all frozen"):
                    net.requires_grad_(when != "all frozen")
                    net.backbone.requires_grad_(False)
                run.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
    finally:
        run.close()


def test_unfrozen_after_an_epoch_then_a_forward_with_grad_before_the_next_step_is_not_mid_step():
    # Validation written without torch.no_grad() after the unfreezing line: a forward between steps.
    run = ddpkit.Run(global_batch=4, micro_batch=2, progress=False)
    net = Net()
    net.backbone.requires_grad_(False)
    model = run.setup(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer)
    loader = run.loader(_data())
    before = net.backbone.weight.detach().clone()
    try:
        for epoch in range(2):
            for x, y in loader:
                run.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            net.backbone.requires_grad_(epoch == 0)
            model(_data().tensors[0])  # grad enabled, between steps
    finally:
        run.finish()
    assert not torch.equal(net.backbone.weight, before), "the unfrozen backbone never trained"


class OwnTorchGenerator(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(3)

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand((), generator=self.gen)


def test_draws_from_a_datasets_own_torch_generator_alone_are_noticed():
    # Its state is 5056 bytes: compared by repr, the draw hid in the elided middle.
    fetch = SeededFetch(OwnTorchGenerator(), seed=3)
    together = fetch.__getitems__(_indices([4, 7], epoch=0))
    assert fetch.drawn == {"gen"}
    assert torch.equal(together[1], fetch.__getitems__(_indices([7], epoch=0))[0])
