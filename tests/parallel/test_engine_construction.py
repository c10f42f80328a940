"""Construction: ranks with different models fail at once with the first difference, on every rank;
ranks with different initial values start from rank 0's."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import run_ranks
from torch import nn

from ddpkit import ConfigError, DataParallel
from ddpkit.diagnostics import oversubscription
from ddpkit.dist import cpu_cores
from ddpkit.parallel.sync import first_difference, param_signature


def _wrap_catching(model: nn.Module) -> str:
    try:
        DataParallel(model)
    except ConfigError as exc:
        # torch's DDP raises RuntimeError for ranks with different models; so must we.
        return f"{'RuntimeError: ' if isinstance(exc, RuntimeError) else ''}{exc}"
    return "no error"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _warnings_when_wrapping(threads: int) -> list[str]:
    """The ddpkit warnings DataParallel logs when built with ``threads`` intra-op threads."""
    before, collect, logger = torch.get_num_threads(), _Collect(), logging.getLogger("ddpkit")
    torch.set_num_threads(threads)
    logger.addHandler(collect)
    try:
        DataParallel(nn.Linear(2, 2))
    finally:
        logger.removeHandler(collect)
        torch.set_num_threads(before)
    return collect.messages


def _construct(env) -> dict:
    wide = 10 + env.rank  # rank 1 builds a wider layer
    torch.manual_seed(env.rank)  # and every rank initializes differently
    same = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    same[1].running_mean.fill_(env.rank)
    wrapped = DataParallel(same)
    return {
        "shape": _wrap_catching(nn.Sequential(nn.Linear(4, wide))),
        "count": _wrap_catching(nn.Sequential(*[nn.Linear(4, 4) for _ in range(1 + env.rank)])),
        "state": [t.clone() for t in [*wrapped.module.parameters(), *wrapped.module.buffers()]],
        "one_thread": _warnings_when_wrapping(1),
        "all_cores": _warnings_when_wrapping(max(2, cpu_cores())),  # 2 processes x every core each
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_construct, 2)


def test_shape_mismatch_names_parameter_shapes_and_ranks(results) -> None:
    for result in results:  # every rank raises, so none is left waiting in a collective
        assert result["shape"].startswith("RuntimeError: ")
        assert "parameter '0.weight' has shape (10, 4) on rank 0 but (11, 4) on rank 1" in result["shape"]
        assert "build the same model" in result["shape"]


def test_parameter_count_mismatch_names_the_first_extra(results) -> None:
    for result in results:
        assert result["count"].startswith("RuntimeError: ")
        assert "rank 0 has 2 parameters and rank 1 has 4" in result["count"]
        assert "'1.weight' on rank 1" in result["count"]


def test_parameters_and_buffers_start_from_rank_0(results) -> None:
    for ours, theirs in zip(results[0]["state"], results[1]["state"], strict=True):
        assert torch.equal(ours, theirs)


def test_oversubscribed_cpu_is_warned_about_with_the_fix(results) -> None:
    cores = cpu_cores()
    for rank, result in enumerate(results):
        assert len(result["all_cores"]) == 1
        message = result["all_cores"][0]
        assert message.startswith(f"rank {rank}: 2 processes on this host x {max(2, cores)} threads each")
        assert f"torch.set_num_threads({max(1, cores // 2)})" in message
        assert result["one_thread"] == []


def test_oversubscription_rule() -> None:
    assert oversubscription(threads=1, local_processes=2, cores=2) is None
    assert oversubscription(threads=4, local_processes=4, cores=16) is None
    assert oversubscription(threads=1, local_processes=4, cores=2) is None  # nothing to lower
    message = oversubscription(threads=2, local_processes=2, cores=2)
    assert "4 compute threads on 2 CPU cores" in message and "torch.set_num_threads(1)" in message
    assert "torch.set_num_threads(3)" in oversubscription(threads=8, local_processes=2, cores=6)


def test_first_difference_spots_dtype_and_requires_grad() -> None:
    base = param_signature(nn.Linear(2, 2))
    assert first_difference(base, param_signature(nn.Linear(2, 2).double()), 3) == (
        "parameter 'weight' has dtype torch.float32 on rank 0 but torch.float64 on rank 3"
    )
    frozen = nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    assert "requires_grad True on rank 0 but False on rank 1" in first_difference(
        base, param_signature(frozen), 1
    )
    assert first_difference(base, base, 1) is None
