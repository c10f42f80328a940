"""The Trainer's diagnostics (ddpkit.Run's): stragglers, non-finite gradients, desync, config mismatch."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_ranks
from torch.utils.data import TensorDataset

from ddpkit.diagnostics.stats import stragglers
from ddpkit.launch import LaunchError
from ddpkit.run import Run
from ddpkit.run.monitor.metrics import read_metrics
from ddpkit.train import JobConfig, Task, Trainer
from ddpkit.train.worker import check_same_job


class SlowOnRank1(torch.nn.Module):
    """A linear model whose forward takes 20 ms longer on rank 1: a straggler."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            time.sleep(0.02)
        return self.net(x)


def _data(n: int = 48, bad: int | None = None) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    y = x.sum(dim=1, keepdim=True)
    if bad is not None:
        x[bad] = float("nan")
    return TensorDataset(x, y)


def _trainer(out: str, model=None, data=None, kind=Trainer, **changes) -> Trainer:
    """A Trainer on a fresh Run; ``model`` is a class, built after the run seeded every rank alike."""
    base = dict(out=out, steps=6, global_batch=8, lr=1e-2, warmup_steps=1, log_every=3, check_every=2)
    cfg = JobConfig.from_values({**base, "progress": False, **changes})
    run = Run(**cfg.run_options())
    task = Task(model() if model else torch.nn.Linear(4, 1), data or _data(), F.mse_loss)
    return kind(run, task, cfg.train)


def _straggler_run(env, out: str, engine: str) -> list[dict]:
    _trainer(out, SlowOnRank1, engine=engine).fit()
    return read_metrics(Path(out) / "metrics.jsonl") if env.is_rank0 else []


def _nan_run(env, out: str, on_nonfinite: str) -> tuple[int, bool]:
    # Sample 5 is NaN; with shuffle it lands in some step on one rank only.
    trainer = _trainer(out, data=_data(bad=5), on_nonfinite=on_nonfinite)
    trainer.fit()
    finite = all(torch.isfinite(p).all() for p in trainer.model.module.parameters())
    return trainer.run._cycle.gate.skipped_steps, finite


def _runs_that_finish(env, root: str) -> dict:
    """The runs that end well, one after another in one world (a world's start-up costs more)."""
    return {
        "torch": _straggler_run(env, f"{root}/torch", "torch"),
        "native": _straggler_run(env, f"{root}/native", "native"),
        "skip": _nan_run(env, f"{root}/skip", "skip"),
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> list[dict]:
    return run_ranks(_runs_that_finish, 2, str(tmp_path_factory.mktemp("finished")))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "native"])
def test_straggler_shows_in_per_rank_timings(finished, engine):
    records = finished[0][engine]
    ranks = records[-1]["ranks"]  # steps 4 to 6: rank 1 spent 3 x 20 ms more in forward
    assert ranks[1]["compute_s"] > 1.5 * ranks[0]["compute_s"]
    # Rank 0 waits those in the all-reduce, which its comm wait holds, not its compute.
    assert ranks[0]["comm_wait_s"] > 0.04 > ranks[1]["comm_wait_s"]
    assert [rank for rank, _ in stragglers(ranks)] == [1]


def test_straggler_rule():
    rows = [{"rank": r, "data_s": 0.0, "compute_s": c, "comm_wait_s": 0.0} for r, c in enumerate([1, 1.1, 2])]
    assert stragglers(rows) == [(2, pytest.approx(2 / 1.05))]  # against the others' median
    assert stragglers([{**row, "compute_s": 0.0} for row in rows]) == []
    # Two ranks, one 30x slower: the factor is 30, not the 1.9 a median over both would give.
    two = [{"rank": r, "data_s": 0.0, "compute_s": c, "comm_wait_s": 0.0} for r, c in enumerate([0.1, 3.0])]
    assert stragglers(two) == [(1, pytest.approx(30.0))]
    # A 2x ratio on sub-millisecond windows is scheduling noise, not a straggler.
    tiny = [{**row, "compute_s": row["compute_s"] / 1000} for row in two]
    assert stragglers(tiny) == []


@pytest.mark.slow
def test_non_finite_gradient_skips_the_step_on_every_rank(finished):
    assert finished[0]["skip"] == finished[1]["skip"] == (1, True)  # the same step on both, weights intact


@pytest.mark.slow
def test_non_finite_gradient_stops_the_run_naming_the_step(tmp_path):
    with pytest.raises(LaunchError, match=r"FloatingPointError: step \d+: the gradient norm is nan"):
        run_ranks(_nan_run, 2, str(tmp_path), "stop")


class Desync(Trainer):
    """After step 3, rank 1's replica drifts: what a bug in user code does silently."""

    def _run_batch(self, batch) -> None:
        super()._run_batch(batch)
        if self.run.step == 3 and self.run.env.rank == 1:
            with torch.no_grad():
                self.model.module.bias += 1.0


def _desync_run(env, out: str) -> None:
    _trainer(out, kind=Desync).fit()


@pytest.mark.slow
def test_desync_is_caught_at_the_next_check(tmp_path):
    with pytest.raises(
        LaunchError,
        match=r"replicas differ at step [45] \(model\): ranks \[1\] disagree with rank 0, first at 'bias'",
    ):
        run_ranks(_desync_run, 2, str(tmp_path))


def _mismatched_config_run(env, out: str) -> None:
    lr = 1e-2 if env.rank == 0 else 2e-2  # what nodes started with different flags would do
    check_same_job(JobConfig.from_values({"out": out, "lr": lr}), env)


@pytest.mark.slow
def test_ranks_with_different_configs_stop_at_start(tmp_path):
    with pytest.raises(LaunchError, match=r"ranks \[1\] run a different configuration"):
        run_ranks(_mismatched_config_run, 2, str(tmp_path))
