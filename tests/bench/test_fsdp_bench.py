"""engine="fsdp" holds 1/N of the parameters, gradients and AdamW state on each of N processes
(within the 1.1 x 1/N goal of ``ddpkit bench fsdp``); torch's DDP holds all of them everywhere.
Bytes, not times: the step-time ratio is the benchmark's, not a test's."""

from __future__ import annotations

import pytest

import ddpkit
from ddpkit.bench.fsdp_bench import GOAL, memory_rank, table
from ddpkit.launch.start_method import FORKSERVER

pytestmark = pytest.mark.slow


def test_each_process_holds_at_most_1_1_over_n_of_the_full_copy():
    # A GPT of 2 blocks of width 64: 0.11M parameters; the most any rank holds counts.
    # The full copy: torch's DDP on one process. Then fsdp on 2 and 3.
    runs = {1: "torch", 2: "fsdp", 3: "fsdp"}
    memory = {
        n: {e: ddpkit.launch(memory_rank, n, (e, 2, 64, 1), start_method=FORKSERVER)} for n, e in runs.items()
    }
    text, fractions = table(memory)
    assert fractions["torch@1"] == pytest.approx(1.0), text
    assert fractions["fsdp@2"] <= GOAL and fractions["fsdp@3"] <= GOAL, text
    assert fractions["fsdp@3"] < fractions["fsdp@2"] * 3 / 2 * GOAL, text
    assert all(r["grads"] and r["optimizer"] for n in (2, 3) for r in memory[n]["fsdp"]), text
