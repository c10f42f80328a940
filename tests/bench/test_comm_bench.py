"""ddpkit bench comm: size parsing, bus factors, the #wrong check, n/a reporting, and a real 2-rank run."""

from __future__ import annotations

import json
import math

import pytest
import torch

import ddpkit
from ddpkit.bench import comm, report
from ddpkit.bench.collectives import COLLECTIVES, Case, Collective, Spec, count_wrong, element_count, reduced
from ddpkit.bench.comm_config import REDOPS, CommConfig, parse_sizes
from ddpkit.cli import main as cli_main
from ddpkit.errors import ConfigError


@pytest.mark.parametrize(
    "text, sizes",
    [
        ("1K:64M", tuple(2**k for k in range(10, 27))),
        ("4M", (4 * 2**20,)),
        ("1k:16KB:4", (1024, 4096, 16384)),
        ("100:300", (100, 200)),
        ("1G", (2**30,)),
    ],
)
def test_parse_sizes_follows_nccl_tests_b_e_f(text, sizes):
    assert parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["", "0", "1X", "64M:1K", "1K:4K:1", "1K:4K:x", "1:2:3:4", "-1K"])
def test_bad_sizes_name_the_value_and_the_fix(text):
    with pytest.raises(ConfigError) as err:
        parse_sizes(text)
    assert "--sizes" in str(err.value)
    assert "1K:64M" in str(err.value)  # the example of a good value


@pytest.mark.parametrize(
    "op, n, factor",
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 8, 1.75),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 4, 0.75),
        ("all_to_all", 4, 0.75),
        ("gather", 2, 0.5),
        ("scatter", 2, 0.5),
        ("broadcast", 8, 1.0),
        ("reduce", 8, 1.0),
        ("sendrecv", 8, 1.0),
        ("isend_irecv", 2, 1.0),
    ],
)
def test_bus_bandwidth_factors_are_nccl_tests(op, n, factor):
    assert math.isclose(COLLECTIVES[op].bus_factor(n), factor)


def test_split_operations_get_a_count_divisible_by_world_size():
    assert element_count(1024, 4, 3, split=True) == 255
    assert element_count(1024, 4, 3, split=False) == 256
    assert element_count(2, 4, 4, split=True) == 4  # never below one element per rank


def test_prod_inputs_are_ones_and_twos_so_products_stay_exact():
    spec = Spec(rank=0, world_size=20, count=64, dtype=torch.float16, redop="prod")
    product = reduced(spec, 64)
    assert torch.isfinite(product).all()
    assert set(torch.log2(product.float()).tolist()) <= set(map(float, range(21)))


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_count_wrong_catches_one_corrupted_element(name):
    collective = COLLECTIVES[name]
    spec = Spec(
        rank=0, world_size=3, count=12, dtype=torch.float32, redop="sum" if collective.reduces else None
    )
    case = collective.build(spec)  # building communicates nothing; only run() does
    output = case.expected.clone()
    assert count_wrong(output, case.expected) == 0
    output[-1] += 1
    assert count_wrong(output, case.expected) == 1
    output[0] = float("nan")
    assert count_wrong(output, case.expected) == 2
    assert count_wrong(output[:-1], case.expected) == case.expected.numel()


def _corrupting(honest: Collective) -> Collective:
    """``honest`` with one element of every result corrupted after each run."""

    def build(spec: Spec) -> Case:
        case = honest.build(spec)

        def run() -> None:
            case.run()
            case.output[0] += 1

        return Case(run, case.output, case.expected)

    return Collective(honest.name, build, honest.bus_factor, reduces=honest.reduces)


def test_an_injected_fault_shows_in_wrong_and_nowhere_else(monkeypatch):
    monkeypatch.setitem(COLLECTIVES, "all_reduce", _corrupting(COLLECTIVES["all_reduce"]))
    cfg = CommConfig(
        ops=("broadcast", "all_reduce"), redops=("sum", "max"), sizes=(64, 256), iters=2, warmup=1
    )
    env = ddpkit.init_distributed("gloo")  # a world of one, in this process
    try:
        records = comm.CommBench(env, cfg).run()
    finally:
        ddpkit.destroy()
    wrong = {(r["op"], r["redop"], r["size_bytes"]): r["wrong"] for r in records}
    assert wrong == {
        ("broadcast", None, 64): 0,
        ("broadcast", None, 256): 0,
        ("all_reduce", "sum", 64): 1,
        ("all_reduce", "sum", 256): 1,
        ("all_reduce", "max", 64): 1,
        ("all_reduce", "max", 256): 1,
    }


def _refuse(spec: Spec) -> Case:
    def run() -> None:
        raise RuntimeError("ProcessGroupGloo does not support refuse")

    return Case(run, None, None)


def test_an_operation_the_backend_refuses_is_reported_not_fatal():
    env = ddpkit.init_distributed("gloo")  # a world of one, in this process
    try:
        bench = comm.CommBench(env, CommConfig(sizes=(1024,), iters=1, warmup=0))
        refused = Collective("refuse", _refuse, lambda n: 1.0)
        assert bench._status(refused, None) == (
            "n/a (gloo does not implement it)",
            "ProcessGroupGloo does not support refuse",
        )
        assert bench._status(COLLECTIVES["sendrecv"], None)[0].startswith("n/a (needs 2 or more processes")
        record = bench._row(refused, None, 1024, "n/a (gloo does not implement it)")
    finally:
        ddpkit.destroy()
    assert record["time_us"] is None and record["wrong"] is None
    assert report.comm_row(record).endswith("n/a (gloo does not implement it)")


@pytest.mark.slow
def test_two_rank_run_checks_every_op_and_redop_and_writes_json_and_png(tmp_path, capfd):
    out, png = tmp_path / "comm.json", tmp_path / "comm.png"
    argv = ["--nproc", "2", "--sizes", "1K:4K", "--iters", "2", "--warmup", "1", "--json", str(out)]
    assert comm.main(argv + ["--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    records = data["records"]
    rows = {(r["op"], r["redop"]) for r in records}
    expected_rows = {(n, op) for n, c in COLLECTIVES.items() for op in (REDOPS if c.reduces else [None])}
    assert rows == expected_rows
    assert len(records) == 3 * len(expected_rows)
    for r in records:
        assert r["status"] == "ok", r
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0 and r["algbw_gbps"] > 0 and r["memcpy_gbps"] > 0
        factor = COLLECTIVES[r["op"]].bus_factor(2)
        assert math.isclose(r["busbw_gbps"], r["algbw_gbps"] * factor)
        assert r["size_bytes"] == 4 * r["count"] and r["type"] == "float"
    assert data["meta"]["world_size"] == 2 and data["meta"]["average"] == "mean"
    assert png.read_bytes()[:4] == b"\x89PNG"
    printed = capfd.readouterr().out  # rank 0 prints the table from its own process
    assert "# Out of bounds values : 0 OK" in printed and "busbw" in printed


def test_cli_reports_bad_flags_as_one_line(capsys):
    assert cli_main(["bench", "comm", "--sizes", "64M:1K"]) == 2
    assert cli_main(["bench", "comm", "--ops", "all_reduce,allreduce"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "'64M:1K'" in err[0] and "'all_reduce,allreduce'" in err[1] and "broadcast" in err[1]
