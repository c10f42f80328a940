"""torch.compile with inductor (on the CPU) on the three engines, compiled before and after
``run.setup``, on 2 processes: the losses of eager, the graphs torch's DDP gets, and a compiled run
killed and run again ends bit-equal (tests/run/compile_script.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import ddpkit_run, logged_losses

import ddpkit
from ddpkit.launch.start_method import FORKSERVER

sys.path.insert(0, str(Path(__file__).parent))
from compile_script import sequential_graphs, train  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("compile_script.py")
ENGINES = ("torch", "native", "fsdp")


def _every_engine() -> dict:
    orders = ("eager", "before", "after")
    runs = {(engine, order): train(engine, order) for engine in ENGINES for order in orders}
    return runs | {("native", "sequential"): sequential_graphs("native")}


def test_inductor_gives_eager_losses_on_every_engine_before_and_after_setup():
    runs = ddpkit.launch(_every_engine, 2, start_method=FORKSERVER)[0]
    sequential = runs.pop(("native", "sequential"))
    for (engine, order), result in runs.items():
        eager = runs[engine, "eager"]["losses"]
        assert len(result["losses"]) == 12
        assert result["losses"] == pytest.approx(eager, rel=1e-5, abs=1e-6), (engine, order)
    # The engine's bookkeeping stays out of the graph, run eagerly at 3 breaks around the
    # module's call: the model compiles as one graph whichever comes first (before this, the
    # native engine made 4 graphs and 5 breaks).
    for engine in ("torch", "native"):
        assert runs[engine, "before"]["graphs"] == runs[engine, "after"]["graphs"] == 1, runs
    assert runs["native", "after"]["breaks"] <= 3
    assert sequential >= 1  # compiled, not run eagerly behind the engine's frames
    # FSDP2's hooks around each sharded group are torch's own graph breaks.
    assert runs["fsdp", "after"]["graphs"] <= 2


def test_a_compiled_run_killed_and_run_again_is_bit_equal(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    ddpkit_run(SCRIPT, whole, 2, timeout=300)
    ddpkit_run(SCRIPT, killed, 2, "--kill-at", "7", code=1, timeout=300)  # mid-epoch 1; step 6 saved
    ddpkit_run(SCRIPT, killed, 2, timeout=300)
    assert logged_losses(killed) == logged_losses(whole)
    weights = torch.load(whole / "model.pt", weights_only=True)
    again = torch.load(killed / "model.pt", weights_only=True)
    assert all(torch.equal(again[k], v) for k, v in weights.items())
