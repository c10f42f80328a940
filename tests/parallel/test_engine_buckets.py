"""Buckets and the reducer's bookkeeping, in this process on a world of one (no spawn needed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit import ConfigError, DataParallel
from ddpkit.parallel import FIRST_BUCKET_BYTES, allreduce_hook, assign_buckets, make_hook
from ddpkit.parallel.checks import default_first_bucket_mb


def _params(*numels: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]


def test_assign_buckets_closes_at_the_cap_with_a_small_first_bucket() -> None:
    params = _params(100, 100, 100, 100, 100)  # 400 bytes each
    assert assign_buckets(params, [4, 3, 2, 1, 0], first_cap_bytes=400, cap_bytes=800) == [
        [4],
        [3, 2],
        [1, 0],
    ]


def test_assign_buckets_may_pass_the_cap_by_one_parameter_like_torch() -> None:
    params = _params(10, 300, 10)
    assert assign_buckets(params, [0, 1, 2], first_cap_bytes=100, cap_bytes=100) == [[0, 1], [2]]


def test_assign_buckets_sets_a_small_last_bucket_apart() -> None:
    params = _params(100, 100, 100, 100, 100, 100)  # 400 bytes each
    order = [5, 4, 3, 2, 1, 0]
    assert assign_buckets(params, order, 400, 10**6, last_cap_bytes=800) == [[5], [4, 3, 2], [1, 0]]


def test_assign_buckets_never_mixes_dtypes() -> None:
    params = _params(10, 10) + _params(10, dtype=torch.float64)
    assert assign_buckets(params, [2, 1, 0], 10**6, 10**6) == [[2], [1, 0]]


class Reordered(nn.Module):
    """Registers ``late`` first but uses it last, so registration order misleads the first buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(256, 256)  # 257 KiB
        self.early = nn.Linear(256, 1024)  # 1 MiB + 4 KiB: a bucket of its own at the 1 MiB cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(self.early(x)[:, :256])


def _names(model: DataParallel) -> list[list[str]]:
    return [[model.reducer.names[i] for i in bucket.indices] for bucket in model.reducer.buckets]


def test_buckets_are_rebuilt_once_in_arrival_order(world_of_one) -> None:
    model = DataParallel(Reordered(), bucket_cap_mb=1)
    assert _names(model)[0] == ["early.bias", "early.weight"]  # reverse registration order: a wrong guess
    model(torch.randn(2, 256)).sum().backward()
    model(torch.randn(2, 256)).sum().backward()  # rebuilt at this forward
    rebuilt = model.reducer.buckets
    # backward reaches `late` first, so its gradients now lead the first bucket
    assert set(_names(model)[0][:2]) == {"late.weight", "late.bias"}
    model(torch.randn(2, 256)).sum().backward()
    assert model.reducer.buckets is rebuilt, "rebuilt once only"


def test_grads_are_views_into_the_buckets(world_of_one) -> None:
    model = DataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    views = None
    for step in range(4):
        optimizer.zero_grad(set_to_none=False)
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        grads = [p.grad for p in model.parameters()]
        if step == 1:  # the buckets were rebuilt at this step's forward; from now on they stay
            views = grads
        if views is not None:
            assert all(a is b for a, b in zip(grads, views, strict=True)), "the same views, step after step"
    storages = {b.buffer.untyped_storage().data_ptr() for b in model.reducer.buckets}
    assert {g.untyped_storage().data_ptr() for g in views} <= storages


def test_no_sync_sends_nothing_and_the_next_backward_sends_each_bucket_once(
    world_of_one, monkeypatch
) -> None:
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a[0].numel()) or real(*a, **k))
    model = DataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), bucket_cap_mb=0.00005)
    with model.no_sync():
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
    assert calls == []
    model(torch.randn(4, 8)).sum().backward()
    assert sorted(calls) == sorted(b.buffer.numel() for b in model.reducer.buckets)


def test_a_custom_hook_sees_every_bucket_in_order(world_of_one) -> None:
    seen = []

    def hook(bucket, process_group, divisor):
        seen.append(bucket.index)
        return allreduce_hook(bucket, process_group, divisor)

    model = DataParallel(
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), bucket_cap_mb=0.00005, compression=hook
    )
    model(torch.randn(4, 8)).sum().backward()
    assert seen == list(range(len(model.reducer.buckets))) and len(seen) > 1


def test_missing_gradient_names_the_parameter_at_the_next_forward(world_of_one) -> None:
    model = DataParallel(nn.ModuleDict({"used": nn.Linear(4, 4), "idle": nn.Linear(4, 4)}))
    model.module.forward = lambda x: model.module["used"](x)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(ConfigError, match=r"idle\.weight.*find_unused_parameters=True"):
        model(torch.randn(2, 4))


def test_bad_arguments_are_config_errors(world_of_one) -> None:
    with pytest.raises(ConfigError, match="bucket_cap_mb 0"):
        DataParallel(nn.Linear(2, 2), bucket_cap_mb=0)
    with pytest.raises(ConfigError, match="first_bucket_mb -1 must be positive"):
        DataParallel(nn.Linear(2, 2), first_bucket_mb=-1)
    with pytest.raises(ConfigError, match="no parameter that requires grad"):
        DataParallel(nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(ConfigError, match="'emb' makes them"):
        DataParallel(nn.ModuleDict({"emb": nn.Embedding(4, 2, sparse=True)}))
    with pytest.raises(ConfigError, match="unknown compression 'int8'"):
        make_hook("int8")


def test_needs_a_process_group() -> None:
    with pytest.raises(ConfigError, match="init_distributed"):
        DataParallel(nn.Linear(2, 2))


def test_first_bucket_is_one_mebibyte() -> None:
    assert FIRST_BUCKET_BYTES == 1024 * 1024


def _sizes_mb(model: DataParallel) -> list[float]:
    return [round(b.nbytes / 2**20, 2) for b in model.reducer.buckets]


def test_on_cpu_one_bucket_up_to_the_cap_unless_a_first_size_is_given(world_of_one) -> None:
    def three_mib() -> nn.Module:
        return nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(3)])  # 1 MiB each

    assert _sizes_mb(DataParallel(three_mib())) == [3.0]  # CPU: no small buckets, one collective
    assert _sizes_mb(DataParallel(three_mib(), bucket_cap_mb=2)) == [2.0, 1.0]
    # torch DDP's layout on request: a 1 MiB first bucket, then the rest, then a 1 MiB last one
    assert _sizes_mb(DataParallel(three_mib(), first_bucket_mb=1)) == [1.0, 1.0, 1.0]
    assert _sizes_mb(DataParallel(three_mib(), first_bucket_mb=0.5)) == [1.0, 1.0, 1.0]


def test_accelerator_parameters_keep_the_small_first_bucket() -> None:
    meta = nn.Linear(2, 2, device="meta")  # any non-CPU device takes the GPU default
    assert default_first_bucket_mb(meta, 25, None) == 1.0
    assert default_first_bucket_mb(nn.Linear(2, 2), 25, None) == 25
    assert default_first_bucket_mb(meta, 25, 4) == 4
