"""``ddpkit train --engine native``: the Trainer on the native engine takes exactly torch DDP's steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from torch.utils.data import TensorDataset

from ddpkit import ConfigError, DataParallel, Run
from ddpkit.run import EngineConfig
from ddpkit.run.monitor.metrics import read_metrics
from ddpkit.train import JobConfig, Task, Trainer

pytestmark = pytest.mark.slow  # each file spawns its ranks once, for a few seconds


def _data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return TensorDataset(x, torch.tanh(x @ torch.linspace(-1, 1, 12).view(6, 2)))


def _fit_both(env, out: str, compression: str | None = None) -> dict:
    results = {}
    for engine in ("torch", "native"):
        # micro_batch 2 of a 6-sample share: two forwards under no_sync, then one reduction
        cfg = JobConfig.from_values(
            dict(out=f"{out}/{engine}", steps=6, global_batch=12, lr=1e-2, warmup_steps=2, log_every=1)
            | dict(eval_every=3, micro_batch=2, engine=engine, progress=False, compression=compression)
        )
        run = Run(**cfg.run_options())
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        trainer = Trainer(run, Task(model, _data(60, 1), F.mse_loss, eval_dataset=_data(20, 2)), cfg.train)
        trainer.fit()
        records = read_metrics(run.out / "metrics.jsonl") if env.is_rank0 else []
        results[engine] = {
            "native": isinstance(trainer.model, DataParallel),  # Run wraps in a subclass of it
            "losses": [(r["loss"], r.get("eval_loss")) for r in records],
            "state": {k: v.clone() for k, v in trainer.model.module.state_dict().items()},
        }
    return results


def _plain_and_powersgd(env, out: str) -> dict:
    # Rank 2 after 3 plain steps: torch's PowerSGDState gets the native hook's settings.
    return {
        "plain": _fit_both(env, f"{out}/plain"),
        "powersgd": _fit_both(env, f"{out}/powersgd", "powersgd:2:3"),
    }


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> list[dict]:
    """Both engines without and with PowerSGD, in one world of 2 ranks (spawned once: its start-up
    costs more than the fits)."""
    return run_ranks(_plain_and_powersgd, 2, str(tmp_path_factory.mktemp("fits")))


def test_native_engine_trains_exactly_like_torch_ddp(fits) -> None:
    for result in (rank["plain"] for rank in fits):
        torch_run, native_run = result["torch"], result["native"]
        assert native_run["native"] and not torch_run["native"]
        assert native_run["losses"] == torch_run["losses"]
        for name, value in torch_run["state"].items():
            assert torch.equal(native_run["state"][name], value), name


def test_a_powersgd_setting_is_the_same_on_both_engines(fits) -> None:
    for result in (rank["powersgd"] for rank in fits):
        torch_run, native_run = result["torch"], result["native"]
        # (loss, eval_loss) pairs, flattened to the numbers: pytest.approx takes no nested
        # structures (pytest >= 9) and no None; the None pattern must match exactly.
        pattern = [
            [value is None for pair in run["losses"] for value in pair] for run in (native_run, torch_run)
        ]
        assert pattern[0] == pattern[1]
        flat = [
            [v for pair in run["losses"] for v in pair if v is not None] for run in (native_run, torch_run)
        ]
        assert flat[0] == pytest.approx(flat[1], rel=1e-5)
        for name, value in torch_run["state"].items():
            torch.testing.assert_close(native_run["state"][name], value, msg=name)
    with pytest.raises(ConfigError, match="powersgd:RANK:START_ITER"):
        EngineConfig(compression="powersgd:x")


def test_unknown_engine_lists_native() -> None:
    with pytest.raises(ConfigError, match="'torch', 'native'"):
        EngineConfig(engine="fast")
