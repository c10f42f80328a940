"""The cost model's arithmetic: ring all-reduce, overlap of buckets with backward, the check."""

from __future__ import annotations

import pytest

from ddpkit.bench import costmodel
from ddpkit.bench.costmodel import Compute, Link


def test_ring_allreduce_moves_twice_the_bytes_over_n_minus_one_steps() -> None:
    link = Link(bandwidth_bps=8e6, latency_s=0.0)  # 1 MB/s
    assert costmodel.ring_allreduce_s(1e6, 2, link) == pytest.approx(1.0)  # 2 steps of 0.5 MB
    assert costmodel.ring_allreduce_s(1e6, 4, link) == pytest.approx(1.5)  # 6 steps of 0.25 MB
    assert costmodel.ring_allreduce_s(1e6, 1, link) == 0.0
    slow = Link(bandwidth_bps=8e6, latency_s=1e-3)
    assert costmodel.ring_allreduce_s(1e6, 4, slow) == pytest.approx(1.5 + 6e-3)


def test_one_bucket_adds_all_communication_and_small_buckets_overlap() -> None:
    compute = Compute(forward_s=0.1, backward_s=0.4, optimizer_s=0.05)
    link = Link(bandwidth_bps=4e6, latency_s=0.0)  # each 0.1 MB bucket: 0.2 s on 2 hosts
    one = costmodel.predict_step_s(compute, [0.4e6], 2, link)
    assert one == pytest.approx(0.1 + 0.4 + 0.8 + 0.05)
    # ready at 0.1, 0.2, 0.3, 0.4 into backward; sent 0.1-0.3, 0.3-0.5, 0.5-0.7, 0.7-0.9
    four = costmodel.predict_step_s(compute, [0.1e6] * 4, 2, link)
    assert four == pytest.approx(0.1 + 0.9 + 0.05)
    fast = Link(bandwidth_bps=8e9, latency_s=0.0)  # all but the last bucket's 0.1 ms hides under backward
    assert costmodel.predict_step_s(compute, [0.1e6] * 4, 2, fast) == pytest.approx(compute.step_s + 1e-4)


def test_layouts_of_the_bench_gpt() -> None:
    params = costmodel.gpt_params()
    total = sum(p.numel() * 4 for p in params)
    buckets = {k: costmodel.layout_buckets(params, v) for k, v in costmodel.named_layouts(params).items()}
    assert buckets["one"] == [total] and buckets["torch"][0] >= 2**20 and len(buckets["torch"]) == 2
    assert sum(buckets["split"]) == total and len(buckets["split"]) > 4
    bf16 = costmodel.engine_buckets("native+bf16", params)
    assert set(bf16) == {"one", "split"} and bf16["one"] == [total // 2]
    assert costmodel.engine_buckets("native@2mb", params)["native@2mb"][0] >= 2 * 2**20
    assert costmodel.engine_buckets("native+powersgd", params) is None


def test_check_predicts_from_the_runs_own_compute_and_rate() -> None:
    params = costmodel.gpt_params()
    total = sum(p.numel() * 4 for p in params)
    link = {"forward_s": 0.1, "backward_s": 0.2, "optimizer_s": 0.02, "link_rate_bps": 8 * total}
    none = {"median_ms": 640.0, "round_medians_ms": [640.0, 1280.0]}  # round 2: a busy machine
    torch_ = {"median_ms": 1700.0, "round_medians_ms": [1700.0, 3400.0]}
    summary = {"hosts": 2, "link": link, "engines": {"none": none, "torch": torch_}}
    (row,) = costmodel.check(summary, latency_s=0.0)
    # compute is each round's none step (round 1: twice the probe's phases); the link sends everything in 1 s,
    # of which the first 1 MiB starts early: forward + backward + the rest of the bytes + optimizer
    rest = 1 - costmodel.layout_buckets(params, costmodel.named_layouts(params)["torch"])[0] / total
    expected = 0.2 + max(0.4, 0.4 + rest) + 0.04
    busy = 0.4 + max(0.8, 0.8 + rest) + 0.08  # round 2: twice the compute, the same link
    assert row["engine"] == "torch" and row["predicted_s"] == pytest.approx((expected + busy) / 2, rel=0.02)
    assert row["error_range"] == pytest.approx((busy / 3.4 - 1, expected / 1.7 - 1), rel=0.05)
