"""``compression="powersgd:RANK[:START_ITER]"`` and the engine bench's ``native+powersgd:RANK`` names."""

from __future__ import annotations

import pytest
from torch import nn

from ddpkit.bench import engine_link, engine_rounds
from ddpkit.errors import ConfigError
from ddpkit.parallel import PowerSGD, make_hook
from ddpkit.parallel.compression import parse_powersgd


def test_powersgd_strings_set_rank_and_start_iter() -> None:
    default = make_hook("powersgd")
    assert isinstance(default, PowerSGD)
    assert (default.matrix_approximation_rank, default.start_iter) == (1, 10)  # torch's rank
    four = make_hook("powersgd:4")
    assert (four.matrix_approximation_rank, four.start_iter) == (4, 10)
    late = parse_powersgd("powersgd:8:50")
    assert (late.matrix_approximation_rank, late.start_iter) == (8, 50)
    assert late.error_feedback and late.warm_start


@pytest.mark.parametrize("spec", ["powersgd:", "powersgd:four", "powersgd:4:5:6", "powersgd:-1", "powersgdx"])
def test_a_malformed_powersgd_string_names_itself_and_the_form(spec: str) -> None:
    with pytest.raises(ConfigError, match=f"'{spec}'.*powersgd:RANK:START_ITER.*powersgd:4"):
        make_hook(spec)


@pytest.mark.parametrize(("spec", "fix"), [("powersgd:0", "at least 1"), ("powersgd:4:1", "start_iter=2")])
def test_an_out_of_range_powersgd_string_names_itself_and_the_fix(spec: str, fix: str) -> None:
    with pytest.raises(ConfigError, match=f"compression '{spec}'.*{fix}"):
        make_hook(spec)


def test_engine_bench_runs_powersgd_at_a_rank_after_its_plain_steps(monkeypatch) -> None:
    cfg = engine_rounds.EngineBenchConfig(engines=("torch", "native+powersgd", "native+powersgd:4:50"))
    assert engine_rounds.warmup_steps(cfg, "native+powersgd") == cfg.warmup + 10
    assert engine_rounds.warmup_steps(cfg, "native+powersgd:4") == cfg.warmup + 10
    assert engine_rounds.warmup_steps(cfg, "native+powersgd:4:50") == cfg.warmup + 50
    monkeypatch.setattr(engine_rounds, "DataParallel", lambda model, **kwargs: kwargs)  # no process group
    assert engine_rounds.wrap("native+powersgd:4:50", nn.Linear(2, 2)) == {"compression": "powersgd:4:50"}
    with pytest.raises(ConfigError, match="unknown names \\['native\\+powersgd4'\\].*powersgd:RANK"):
        engine_rounds.EngineBenchConfig(engines=("native+powersgd4",))
    with pytest.raises(ConfigError, match="'powersgd:0'.*at least 1"):
        engine_rounds.EngineBenchConfig(engines=("native+powersgd:0",))


def test_link_bench_targets_the_powersgd_setting_it_runs_by_default() -> None:
    chosen = [name for name, _ in engine_link.LINK_TARGETS if "powersgd" in name]
    assert chosen and set(chosen) <= set(engine_rounds.LINK_ENGINES.split(","))
    # every default name is valid
    engine_rounds.EngineBenchConfig(engines=tuple(engine_rounds.LINK_ENGINES.split(",")))
