"""The Trainer as a library, on ddpkit.Run: exact evaluation, micro-batching, precision, the user's
own optimizer and scheduler, models that return their loss, dict batches, DataLoader workers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from torch.utils.data import Dataset, TensorDataset

from ddpkit.diagnostics import check_replicas_agree
from ddpkit.errors import ConfigError
from ddpkit.run import Run
from ddpkit.run.metrics import read_metrics
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
    parts = {"model": _model, "dataset": _data(60, 1), "loss_fn": F.mse_loss, "eval_dataset": _data(41, 2)}
    parts.update(task or {})
    parts["model"] = parts["model"]()  # built here, after the run seeded every rank alike
    trainer = Trainer(run, Task(**parts), cfg.train)
    trainer.fit()
    records = read_metrics(trainer.run.out / "metrics.jsonl") if env.is_rank0 else []
    return records, {k: v.clone() for k, v in trainer.model.module.state_dict().items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_eval_is_exact_over_uneven_shards_and_matches_one_process(tmp_path, world_size):
    (one, one_state), *_ = run_ranks(fit, 1, str(tmp_path / "w1"), 6)
    (many, many_state), *_ = run_ranks(fit, world_size, str(tmp_path / "wn"), 6)
    assert one[-1]["eval_samples"] == many[-1]["eval_samples"] == 41  # no padding counted
    assert many[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)
    for name in one_state:
        torch.testing.assert_close(many_state[name], one_state[name], rtol=1e-5, atol=1e-6)


def test_micro_batches_accumulate_to_the_same_step(tmp_path):
    whole = run_ranks(fit, 2, str(tmp_path / "a"), 5)
    micro = run_ranks(fit, 2, str(tmp_path / "b"), 5, {"micro_batch": 2})  # 3 micro-batches per rank
    for name, value in whole[0][1].items():
        torch.testing.assert_close(micro[0][1][name], value, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(micro[0][1][k], micro[1][1][k]) for k in micro[0][1])


def test_bf16_autocast_trains_like_fp32(tmp_path):
    bf16 = [r["loss"] for r in run_ranks(fit, 2, str(tmp_path / "a"), 20, {"precision": "bf16"})[0][0]]
    fp32 = [r["loss"] for r in run_ranks(fit, 2, str(tmp_path / "b"), 20)[0][0]]
    assert bf16[-1] < 0.7 * bf16[0]
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.1)  # bf16 keeps ~3 significant digits
    assert bf16 != fp32  # autocast really ran in bf16


def test_fp16_on_cpu_is_refused(tmp_path):
    with pytest.raises(Exception, match=r"precision='fp16' \(a GradScaler\)"):
        run_ranks(fit, 1, str(tmp_path), 2, {"precision": "fp16"})


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def test_the_tasks_own_optimizer_and_scheduler_are_used_as_given(tmp_path):
    records, _ = run_ranks(fit, 2, str(tmp_path), 6, None, {"optimizer": _sgd, "scheduler": _halving})[0]
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


def test_a_model_that_returns_its_loss_from_dict_batches_with_workers_trains_the_same(tmp_path):
    # 8 steps of 5 an epoch: the workers persist into the second epoch.
    plain = run_ranks(fit, 2, str(tmp_path / "a"), 8)[0]
    task = {"model": ReturnsLoss, "dataset": Dicts(_data(60, 1)), "loss_fn": None, "eval_dataset": None}
    dicts = run_ranks(fit, 2, str(tmp_path / "b"), 8, {"num_workers": 2}, task)[0]
    assert [r["loss"] for r in dicts[0]] == pytest.approx([r["loss"] for r in plain[0]], rel=1e-6)
    for name, value in plain[1].items():
        torch.testing.assert_close(dicts[1][f"net.{name}"], value, rtol=1e-6, atol=1e-7)


class Logits(ReturnsLoss):
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_model_without_a_loss_and_no_loss_fn_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match=r"must return its loss .* it returned a tensor of shape \(12, 2\)"):
        run_ranks(fit, 1, str(tmp_path), 2, None, {"model": Logits, "loss_fn": None})


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


def test_desynced_replica_is_named():
    messages = run_ranks(_desynced, 3)
    assert messages[0] == messages[2] == messages[1]
    assert "ranks [1] disagree with rank 0, first at '1.bias'" in messages[0]


def test_config_rejects_unknown_keys():
    with pytest.raises(ConfigError, match=r"unknown settings \['stpes'\]"):
        JobConfig.from_values({"stpes": 3})
    with pytest.raises(ConfigError, match=r"unknown keys \['global_batch'\] in section 'engine'"):
        JobConfig.from_json('{"engine": {"global_batch": 3}}')
