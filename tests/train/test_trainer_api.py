"""The Trainer as a library: a user's own model and data, exact evaluation, micro-batching, precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from torch.utils.data import TensorDataset

from ddpkit.diagnostics import check_replicas_agree
from ddpkit.errors import ConfigError
from ddpkit.train import TrainConfig, Trainer


def _data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return TensorDataset(x, x @ torch.arange(12.0).view(6, 2) / 10)


def _fit(env, out: str, steps: int, cfg: dict | None = None) -> tuple[list[dict], dict, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    config = TrainConfig(
        out=out,
        steps=steps,
        global_batch=12,
        lr=1e-2,
        warmup_steps=2,
        log_every=1,
        eval_every=steps,
        **(cfg or {}),
    )
    trainer = Trainer(model, _data(60, 1), F.mse_loss, env, config, eval_dataset=_data(41, 2))
    records = trainer.fit()
    state = {k: v.clone() for k, v in trainer.model.module.state_dict().items()}
    return records, records[-1], state


@pytest.mark.parametrize("world_size", [2, 3])
def test_eval_is_exact_over_uneven_shards_and_matches_one_process(tmp_path, world_size):
    (_, one, one_state), *_ = run_ranks(_fit, 1, str(tmp_path / "w1"), 6)
    (_, many, many_state), *_ = run_ranks(_fit, world_size, str(tmp_path / "wn"), 6)
    assert one["eval_samples"] == many["eval_samples"] == 41  # 41 over 2 or 3 ranks: no padding counted
    assert many["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    for name in one_state:
        torch.testing.assert_close(many_state[name], one_state[name], rtol=1e-5, atol=1e-6)


def test_micro_batches_accumulate_to_the_same_step(tmp_path):
    whole = run_ranks(_fit, 2, str(tmp_path / "a"), 5)
    micro = run_ranks(_fit, 2, str(tmp_path / "b"), 5, {"micro_batch": 2})  # 3 micro-batches per rank
    for name, value in whole[0][2].items():
        torch.testing.assert_close(micro[0][2][name], value, rtol=1e-5, atol=1e-6)
    # no_sync kept the replicas apart until the last micro-batch, then one all-reduce made them equal
    assert all(torch.equal(micro[0][2][k], micro[1][2][k]) for k in micro[0][2])


def test_bf16_autocast_trains_like_fp32(tmp_path):
    bf16 = [r["loss"] for r in run_ranks(_fit, 2, str(tmp_path / "a"), 20, {"precision": "bf16"})[0][0]]
    fp32 = [r["loss"] for r in run_ranks(_fit, 2, str(tmp_path / "b"), 20)[0][0]]
    assert bf16[-1] < 0.7 * bf16[0]
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.1)  # bf16 keeps ~3 significant digits
    assert bf16 != fp32  # autocast really ran in bf16


def test_fp16_on_cpu_is_refused(tmp_path):
    with pytest.raises(Exception, match="--precision fp16 needs a GPU"):
        run_ranks(_fit, 1, str(tmp_path), 2, {"precision": "fp16"})


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
    with pytest.raises(ConfigError, match=r"unknown config keys \['stpes'\]"):
        TrainConfig.from_json('{"stpes": 3}')
