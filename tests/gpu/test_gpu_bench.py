"""``ddpkit bench engine`` on a GPU machine: it runs to the end and prints its ratio table.

The engine benchmark has no CUDA mode today: its ranks join over gloo and train CPU copies of
the GPT (src/ddpkit/bench/engine_rounds.py), so on a GPU machine it measures the CPU engines.
This test keeps it working there; speed is not asserted (speed goals live in benchmarks, not in
tests).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ddpkit.bench.engine_rounds import DEFAULT_ENGINES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A 2-layer GPT of width 64, 4 rounds of 1 timed step per engine, no peak-RSS runs: seconds of
# work, well within a minute with process start-up.
FLAGS = (
    "--nproc 2 --blocks 4 --steps-per-block 1 --warmup 1 --batch 4 --seq 32 "
    "--n-layer 2 --n-embd 64 --n-head 4 --no-memory"
)


def test_bench_engine_prints_its_ratio_table(tmp_path):
    summary_file = tmp_path / "engine.json"
    cmd = [sys.executable, "-m", "ddpkit", "bench", "engine", *FLAGS.split(), "--json", str(summary_file)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("engine") and "/torch" in line), None)
    assert header is not None, done.stdout
    engines = DEFAULT_ENGINES.split(",")
    # One row per engine, in order, right under the header (the layout-trial lines follow).
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 1 + len(engines)]}
    assert list(rows) == engines, done.stdout
    # Column 4 is the ratio to torch DDP's median step: 1.000 for torch itself, a number for the rest.
    assert rows["torch"][3] == "1.000"
    assert all(float(row[3]) > 0 for row in rows.values()), done.stdout
    assert "target native / torch <= 1.00" in done.stdout
    summary = json.loads(summary_file.read_text())
    assert set(summary["engines"]) == set(engines)
