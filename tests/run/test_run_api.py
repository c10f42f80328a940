"""ddpkit.Run's promises, checked against one process on the whole global batch, and its errors."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit
from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.errors import ConfigError
from ddpkit.launch.start_method import FORKSERVER


def _data(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randn(n, 2, generator=gen))


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(out, n: int, global_batch: int, micro_batch: int | None, zero_last: bool) -> dict:
    """One epoch of a user loop; ``zero_last`` calls zero_grad after step instead of before backward."""
    run = ddpkit.Run(
        out=out, global_batch=global_batch, micro_batch=micro_batch, progress=False, seed=5, log_every=1
    )
    model = run.setup(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    run.track(optimizer, scheduler)
    lrs = []
    for x, y in run.loader(_data(n)):
        if not zero_last:
            optimizer.zero_grad()
        run.backward(F.mse_loss(model(x), y))
        lrs.append((run.step, optimizer.param_groups[0]["lr"]))  # the same for each micro-batch of a step
        optimizer.step()
        scheduler.step()
        if zero_last:
            optimizer.zero_grad()
    weights = {k: v.clone() for k, v in model.module.state_dict().items()}
    run.finish()
    return {
        "weights": weights,
        "lrs": list(dict(lrs).values()),
        "steps": run.step,
        "momentum": "momentum_buffer" in optimizer.state[optimizer.param_groups[0]["params"][0]],
    }


def _reference(n: int, global_batch: int) -> tuple[dict, list[float], list[float]]:
    """The same epoch in one process, one plain step per global batch: weights, lrs and losses."""
    data, model = _data(n), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    sampler, lrs, losses = GlobalBatchSampler(n, global_batch, 0, 1, seed=5), [], []
    for batch in sampler.epoch_batches():
        x, y = data[batch]
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return model.state_dict(), lrs, losses


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "n", "global_batch", "micro_batch", "zero_last"),
    [
        (
            2,
            21,
            10,
            2,
            False,
        ),  # shares of 5 in micro-batches 2+2+1; the last global batch (1) leaves rank 1 empty
        (3, 20, 9, None, True),  # the last batch of 2 leaves rank 2 empty; zero_grad after step
        (1, 21, 10, 3, True),
    ],
)
def test_an_epoch_equals_one_process_on_each_global_batch(
    tmp_path, world, n, global_batch, micro_batch, zero_last
):
    ranks = ddpkit.launch(
        _train,
        world,
        (str(tmp_path / "run"), n, global_batch, micro_batch, zero_last),
        start_method=FORKSERVER,
    )
    expected, lrs, losses = _reference(n, global_batch)
    # The logged loss of every step is the mean over its global batch, as one process computes it.
    logged = [
        json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(logged) == len(losses)
    for step, (a, b) in enumerate(zip(losses, logged, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: one process's loss {a}, world {world}'s {b}"
    for result in ranks:
        assert result["steps"] == len(lrs)
        assert result["lrs"] == lrs, "the user's LambdaLR must step once per global batch"
        assert result["momentum"], "the user's SGD with momentum must be the optimizer that steps"
        for name, value in expected.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _evaluate(n: int) -> dict:
    run = ddpkit.Run(progress=False)
    data = _data(n)
    try:
        return run.evaluate(
            data, lambda batch: {"x0": batch[0][:, 0].mean(), "y": batch[1].mean()}, batch_size=3
        )
    finally:
        run.finish()


@pytest.mark.slow
def test_evaluate_is_exact_over_uneven_shards_and_the_same_to_the_bit_on_one_process():
    n = 10  # batches of 3, 3, 3 and 1: two on rank 0, one each on ranks 1 and 2
    results = ddpkit.launch(_evaluate, 3, (n,), start_method=FORKSERVER)
    x, y = _data(n).tensors
    alone = _evaluate(n)  # a world of one, in this process
    for result in results:
        assert result == alone  # the same batches' float32 means, added in the same order
        assert result["samples"] == n
        assert result["x0"] == pytest.approx(x[:, 0].mean().item(), abs=1e-6)
        assert result["y"] == pytest.approx(y.mean().item(), abs=1e-6)


def _differs_on_rank1() -> None:
    run = ddpkit.Run(progress=False)
    try:
        torch.manual_seed(run.env.rank)  # a per-rank seed after Run seeded everyone alike
        run.setup(nn.Linear(3, 3))
    finally:
        run.close()


@pytest.mark.slow
def test_a_model_that_differs_between_ranks_is_one_clear_error():
    with pytest.raises(
        ddpkit.LaunchError, match=r"replicas differ at run.setup.*ranks \[1\].*do not seed per rank"
    ):
        ddpkit.launch(_differs_on_rank1, 2, start_method=FORKSERVER)


def _non_finite() -> None:
    run = ddpkit.Run(global_batch=4, progress=False)
    try:
        model = run.setup(nn.Linear(6, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        run.track(optimizer)
        for x, y in run.loader(_data(8)):
            run.backward(F.mse_loss(model(x), y) * float("inf"))
            optimizer.step()
    finally:
        run.close()


@pytest.mark.slow
def test_a_non_finite_gradient_stops_every_rank_naming_the_step():
    with pytest.raises(ddpkit.LaunchError, match=r"step 1: the gradient norm is (inf|nan) on every rank"):
        ddpkit.launch(_non_finite, 2, start_method=FORKSERVER)


def _saved_run(out: str, with_scheduler: bool) -> None:
    with ddpkit.Run(out=out, global_batch=4, save_every=1, progress=False) as run:  # closed on errors too
        model = run.setup(nn.Linear(6, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.track(optimizer, *([torch.optim.lr_scheduler.StepLR(optimizer, 1)] if with_scheduler else []))
        for x, y in run.loader(_data(8)):
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()


def test_a_resume_whose_checkpoint_holds_other_objects_is_refused(tmp_path):
    _saved_run(str(tmp_path), with_scheduler=True)
    with pytest.raises(ConfigError, match=r"holds \['scheduler'\], which this run did not register"):
        _saved_run(str(tmp_path), with_scheduler=False)


def test_bad_input_is_one_line_naming_the_value_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown options \['global_bach'\]"):
        ddpkit.Run(global_bach=3)
    with pytest.raises(ConfigError, match=r"out='' names no folder"):
        ddpkit.Run(out="")
    with pytest.raises(ConfigError, match=r"save_every=5 needs out=FOLDER"):
        ddpkit.Run(save_every=5)
    run = ddpkit.Run(progress=False)
    try:
        with pytest.raises(ConfigError, match=r"needs global_batch=N"):
            run.loader(_data(8))
        sampled = DataLoader(
            _data(8), batch_size=4, sampler=DistributedSampler(_data(8), num_replicas=1, rank=0)
        )
        with pytest.raises(ConfigError, match=r"replaces the DataLoader's sampler \(DistributedSampler\)"):
            run.loader(sampled)
    finally:
        run.close()


def test_one_run_per_folder_and_a_stale_lock_never_blocks(tmp_path):
    first = ddpkit.Run(out=tmp_path, progress=False)
    try:
        with pytest.raises(
            ConfigError, match=rf"is in use by a running ddpkit run \(pid {os.getpid()} on host"
        ):
            ddpkit.Run(out=tmp_path, progress=False)  # joins the first run's group, then meets its lock
    finally:
        first.close()
    holder = (
        "from ddpkit.checkpoint.lock import OutLock; import os, sys; "
        "OutLock(sys.argv[1]).acquire(); os.kill(os.getpid(), 9)"
    )
    died = subprocess.run([sys.executable, "-c", holder, str(tmp_path)])
    assert died.returncode == -9
    ddpkit.Run(out=tmp_path, progress=False).close()  # the kernel released the dead holder's lock


def test_a_one_element_loss_is_logged_and_a_loss_per_sample_is_one_line(tmp_path):
    run = ddpkit.Run(out=tmp_path, global_batch=4, progress=False, log_every=1)
    try:
        model = run.setup(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.track(optimizer)
        losses = []
        for x, y in run.loader(_data(8)):
            optimizer.zero_grad()
            if run.step == 2:
                per_sample = F.mse_loss(model(x), y, reduction="none").mean(dim=1)
                with pytest.raises(ConfigError, match=r"got shape \(4,\): reduce it first"):
                    run.backward(per_sample)
            loss = F.mse_loss(model(x), y).reshape(1)  # shape (1,): backward takes it, so does the log
            losses.append(loss.item())
            run.backward(loss)
            optimizer.step()
        run.finish()
    finally:
        run.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["loss"] for line in lines] == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize("engine", ["torch", "native", "fsdp"])
def test_a_finished_run_lets_the_model_go(engine):
    # A notebook trains, finishes and trains again: the first model (on a GPU, its weights, gradients
    # and optimizer state) must not stay alive. A post-accumulate-grad hook whose closure reached
    # the model did that: torch cannot collect a cycle through such a hook.
    net = _model()
    gone = weakref.ref(net)
    with ddpkit.Run(global_batch=8, engine=engine, progress=False) as run:
        model = run.setup(net)
        optimizer = torch.optim.AdamW(model.parameters())
        run.track(optimizer)
        for x, y in run.loader(_data(16)):
            optimizer.zero_grad()
            run.backward(F.mse_loss(model(x), y))
            optimizer.step()
    del net, model, optimizer, run, x, y
    gc.collect()
    assert gone() is None


def test_a_metrics_line_names_the_epoch_its_step_ran_in(tmp_path):
    # An epoch's last step is logged at the next step's start (or the run's end), when the loader
    # is on the next pass already: its line says the epoch of the step, not the loader's.
    with ddpkit.Run(out=tmp_path, global_batch=4, progress=False, log_every=1) as run:
        model = run.setup(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.track(optimizer)
        loader = run.loader(_data(8))
        for epoch in range(2):
            for x, y in loader:
                optimizer.zero_grad()
                run.backward(F.mse_loss(model(x), y))
                optimizer.step()
            run.log(val=float(epoch))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {line["step"]: line["epoch"] for line in lines if "loss" in line}
    assert steps == {1: 0, 2: 0, 3: 1, 4: 1}
    assert [(line["step"], line["epoch"]) for line in lines if "val" in line] == [(2, 0), (4, 1)]
