"""Issue 34 on a GPU: a model built on meta gets a file's weights on cuda:0 (fsdp, a world of one),
and with ``offload=True`` a model whose parameters, gradients and AdamW state exceed a memory cap
set on the GPU trains, and matches the same job without the cap (skipped without a GPU)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WIDTH, DEPTH = 4096, 8  # 8 x 16.8M parameters: 537 MB in fp32, 2.1 GB with gradients and AdamW


def _net() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)))


def _train(weights: str, **options) -> list[float]:
    # The with block closes the run (and its process group) if a step fails, so the tests after
    # this one start clean.
    with ddpkit.Run(
        global_batch=8, engine="fsdp", progress=False, shard_modules=["Linear"], **options
    ) as run:
        with torch.device("meta"):
            net = _net()
        model = run.setup(net, weights=weights)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        run.track(optimizer)
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, WIDTH, generator=gen), torch.randn(32, WIDTH, generator=gen))
        losses = []
        for x, y in run.loader(data):
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            run.backward(loss)
            optimizer.step()
            losses.append(loss.item())
    return losses


def test_a_meta_model_from_a_file_and_offloaded_under_a_memory_cap(tmp_path):
    torch.manual_seed(0)
    torch.save(_net().state_dict(), tmp_path / "net.pt")
    plain = _train(str(tmp_path / "net.pt"))
    # The first job's 2.1 GB sit in reference cycles (FSDP2's state and the model) until Python's
    # collector runs: under the cap below they made the second job run out of memory (H200).
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1e9 / total)  # 1 GB: less than the 2.1 GB of state
    try:
        offloaded = _train(str(tmp_path / "net.pt"), offload=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert offloaded == pytest.approx(plain, rel=1e-5)
