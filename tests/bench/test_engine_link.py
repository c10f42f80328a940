"""``ddpkit bench engine --link``: rates, the ideals' arithmetic, and one tiny run on emulated hosts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from ddpkit.bench import engine_link, netns
from ddpkit.cli import main as cli_main
from ddpkit.errors import ConfigError


def test_rates_parse_as_tc_writes_them() -> None:
    assert netns.parse_rate("300mbit") == 300e6
    assert netns.parse_rate("1gbit") == netns.parse_rate("1G") == 1e9
    assert netns.parse_rate("25gbit") == 25e9 and netns.parse_rate("64kbit") == 64e3
    with pytest.raises(ConfigError, match="link rate 'fast' is not a rate; write it as tc does"):
        netns.parse_rate("fast")


def _timed(forward: float, backward: float, optimizer: float, allreduce: float) -> dict:
    extra = {"forward_s": forward, "backward_s": backward, "optimizer_s": optimizer}
    extra |= {"allreduce_s": allreduce, "allreduce_bytes": 19_000_000}
    slower = extra | {"backward_s": backward - 0.01}  # the slowest host sets each phase
    return {"ranks": [{"extra": extra}, {"extra": slower}], "hosts": 2, "rate_bps": 300e6}


def test_ideals_are_max_and_overlap_of_the_measured_phases() -> None:
    got = engine_link.ideals(_timed(forward=0.15, backward=0.30, optimizer=0.02, allreduce=0.50))
    assert got["compute_s"] == pytest.approx(0.47)
    assert got["ideal_max_s"] == pytest.approx(0.50)  # the link is the bottleneck
    assert got["ideal_overlap_s"] == pytest.approx(0.15 + 0.50 + 0.02)  # backward hides under comm
    # a ring on 2 hosts sends the whole buffer once from each host
    assert got["link_rate_measured_bps"] == pytest.approx(8 * 19e6 / 0.5)
    fast = engine_link.ideals(_timed(forward=0.15, backward=0.30, optimizer=0.02, allreduce=0.1))
    assert fast["ideal_max_s"] == fast["compute_s"] == fast["ideal_overlap_s"]


@pytest.mark.slow
def test_tiny_run_on_two_capped_hosts(tmp_path, capsys) -> None:
    reason = engine_link.unavailable()
    out = tmp_path / "link.json"
    tiny = "--blocks 2 --steps-per-block 1 --warmup 1 --batch 2 --seq 8 --n-layer 1 --n-embd 16 --n-head 2"
    argv = [
        "bench",
        "engine",
        "--link",
        "1gbit",
        *tiny.split(),
        "--engines",
        "none,torch,native",
        "--json",
        str(out),
    ]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    if reason:
        assert printed.strip() == reason  # says why, and is not a failure
        pytest.skip(reason)
    summary = json.loads(out.read_text())
    assert set(summary["engines"]) == {"none", "torch", "native"} and summary["hosts"] == 2
    link = summary["link"]
    assert link["link_rate_bps"] == 1e9 and 0 < link["link_rate_measured_bps"] < 1.2e9
    assert "ideal max(compute, comm)" in printed and "target native / torch <= 0.85" in printed
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dkh{os.getpid()}x" not in left and f"dks{os.getpid()}" not in left, left  # all removed
