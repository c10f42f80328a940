"""The Trainer as a library, on ddpkit.Run: exact evaluation, micro-batching, precision, the user's
own optimizer and scheduler, models that return their loss, dict batches, DataLoader workers."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from torch.utils.data import Dataset, TensorDataset

from ddpkit.diagnostics import check_replicas_agree
from ddpkit.errors import ConfigError
from ddpkit.run import Run
from ddpkit.run.monitor.metrics import read_metrics
from ddpkit.train import JobConfig, Task, Trainer


def _data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return TensorDataset(x, x @ torch.arange(12.0).view(6, 2) / 10)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def fit(env, out: str, steps: int, changes: dict | None = None, task: dict | None = None):
    """Train the small regression task; (rank 0's metrics records, the final weights)."""
    values = dict(out=out, steps=steps, global_batch=12, lr=1e-2, warmup_steps=2, log_every=1)
    cfg = JobConfig.from_values({**values, "eval_every": steps, "progress": False, **(changes or {})})
    run = Run(**cfg.run_options())
    try:
        parts = {
            "model": _model,
            "dataset": _data(60, 1),
            "loss_fn": F.mse_loss,
            "eval_dataset": _data(41, 2),
        }
        parts.update(task or {})
        parts["model"] = parts["model"]()  # built here, after the run seeded every rank alike
        trainer = Trainer(run, Task(**parts), cfg.train)
        trainer.fit()
    finally:
        run.close()  # also after an error, so that the next fit of the same world starts clean
    records = read_metrics(trainer.run.out / "metrics.jsonl") if env.is_rank0 else []
    return records, {k: v.clone() for k, v in trainer.model.module.state_dict().items()}


def _error(env, out: str, steps: int, changes: dict | None = None, task: dict | None = None) -> str:
    """What fit raised, as 'Type: message'."""
    try:
        fit(env, out, steps, changes, task)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


# Every fit of the file in three spawned worlds (of 1, 2 and 3 ranks) rather than one world per fit:
# a world's start-up (each rank imports torch) costs more than its fits.
def _world_of_one(env, root: str) -> dict:
    return {
        "eval": fit(env, f"{root}/eval", 6),
        "fp16": _error(env, f"{root}/fp16", 2, {"precision": "fp16"}),
        "logits": _error(env, f"{root}/logits", 2, None, {"model": Logits, "loss_fn": None}),
    }


def _world_of_two(env, root: str) -> dict:
    dicts = {"model": ReturnsLoss, "dataset": Dicts(_data(60, 1)), "loss_fn": None, "eval_dataset": None}
    return {
        "eval": fit(env, f"{root}/eval", 6),
        "whole": fit(env, f"{root}/whole", 5),
        "micro": fit(env, f"{root}/micro", 5, {"micro_batch": 2}),  # 3 micro-batches per rank
        "bf16": fit(env, f"{root}/bf16", 20, {"precision": "bf16"}),
        "fp32": fit(env, f"{root}/fp32", 20),
        "own": fit(env, f"{root}/own", 6, None, {"optimizer": _sgd, "scheduler": _halving}),
        # 8 steps of 5 an epoch: the workers persist into the second epoch.
        "plain": fit(env, f"{root}/plain", 8),
        "dicts": fit(env, f"{root}/dicts", 8, {"num_workers": 2}, dicts),
    }


def _world_of_three(env, root: str) -> dict:
    return {"eval": fit(env, f"{root}/eval", 6), "desynced": _desynced(env)}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, list[dict]]:
    """Each world's results, one dict per rank."""
    root = tmp_path_factory.mktemp("trainer_api")
    parts = {1: _world_of_one, 2: _world_of_two, 3: _world_of_three}
    return {size: run_ranks(part, size, str(root / f"w{size}")) for size, part in parts.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_eval_is_exact_over_uneven_shards_and_matches_one_process(worlds, world_size):
    one, one_state = worlds[1][0]["eval"]
    many, many_state = worlds[world_size][0]["eval"]
    assert one[-1]["eval_samples"] == many[-1]["eval_samples"] == 41  # no padding counted
    assert many[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)
    for name in one_state:
        torch.testing.assert_close(many_state[name], one_state[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_micro_batches_accumulate_to_the_same_step(worlds):
    whole, micro = ([rank[name] for rank in worlds[2]] for name in ("whole", "micro"))
    for name, value in whole[0][1].items():
        torch.testing.assert_close(micro[0][1][name], value, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(micro[0][1][k], micro[1][1][k]) for k in micro[0][1])


@pytest.mark.slow
def test_bf16_autocast_trains_like_fp32(worlds):
    bf16 = [r["loss"] for r in worlds[2][0]["bf16"][0]]
    fp32 = [r["loss"] for r in worlds[2][0]["fp32"][0]]
    assert bf16[-1] < 0.7 * bf16[0]
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.1)  # bf16 keeps ~3 significant digits
    assert bf16 != fp32  # autocast really ran in bf16


@pytest.mark.slow
def test_fp16_on_cpu_is_refused(worlds):
    assert worlds[1][0]["fp16"].startswith("ConfigError: ")
    assert "precision='fp16' (a GradScaler)" in worlds[1][0]["fp16"]


@pytest.mark.slow
def test_the_tasks_own_optimizer_and_scheduler_are_used_as_given(worlds):
    records, _ = worlds[2][0]["own"]
    # The rate each step ran at: the user's StepLR, never overwritten by a schedule of ddpkit's.
    assert [r["lr"] for r in records] == pytest.approx([0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125])


class ReturnsLoss(torch.nn.Module):
    """A HuggingFace-style model: takes the labels, returns {"loss", "logits"}."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.net(x)
        return {"loss": F.mse_loss(logits, labels), "logits": logits}


class Dicts(Dataset):
    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        x, y = self.base[i]
        return {"x": x, "labels": y}


@pytest.mark.slow
def test_a_model_that_returns_its_loss_from_dict_batches_with_workers_trains_the_same(worlds):
    plain, dicts = worlds[2][0]["plain"], worlds[2][0]["dicts"]
    assert [r["loss"] for r in dicts[0]] == pytest.approx([r["loss"] for r in plain[0]], rel=1e-6)
    for name, value in plain[1].items():
        torch.testing.assert_close(dicts[1][f"net.{name}"], value, rtol=1e-6, atol=1e-7)


class Logits(ReturnsLoss):
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.slow
def test_a_model_without_a_loss_and_no_loss_fn_is_a_clear_error(worlds):
    message = worlds[1][0]["logits"]
    assert re.search(r"must return its loss .* it returned a tensor of shape \(12, 2\)", message), message


def _desynced(env) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    if env.rank == 1:
        with torch.no_grad():
            model[1].bias += 1e-3
    try:
        check_replicas_agree(model, env, "in the test")
    except RuntimeError as exc:
        return str(exc)
    return "agreed"


@pytest.mark.slow
def test_desynced_replica_is_named(worlds):
    messages = [rank["desynced"] for rank in worlds[3]]
    assert messages[0] == messages[2] == messages[1]
    assert "ranks [1] disagree with rank 0, first at '1.bias'" in messages[0]


def test_config_rejects_unknown_keys():
    with pytest.raises(ConfigError, match=r"unknown settings \['stpes'\]"):
        JobConfig.from_values({"stpes": 3})
    with pytest.raises(ConfigError, match=r"unknown keys \['global_batch'\] in section 'engine'"):
        JobConfig.from_json('{"engine": {"global_batch": 3}}')
