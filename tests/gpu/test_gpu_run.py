"""ddpkit.Run in a world of one on a GPU, in this process: where the model and the batches live,
pinned host memory for run.loader, and NCCL (what backend="auto" picks here) training as a plain
single-GPU loop does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.run.engine.wrap import unwrap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA0 = torch.device("cuda", 0)  # LOCAL_RANK 0: a world of one without a launcher


def _data(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randn(n, 2, generator=gen))


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def test_a_world_of_one_puts_the_model_and_every_batch_on_cuda_0_from_pinned_memory():
    with ddpkit.Run(global_batch=8, micro_batch=4, progress=False) as run:
        assert (run.env.backend, run.device, run.local_rank, run.world_size) == ("nccl", CUDA0, 0, 1)
        assert torch.cuda.current_device() == 0  # set before the process group, so NCCL binds to it
        model = run.setup(_model())
        assert {p.device for p in model.parameters()} == {CUDA0}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.track(optimizer)
        # Two workers: pinning then happens in the DataLoader's pin-memory thread.
        loader = run.loader(_data(24), num_workers=2)
        assert loader.dataloader.pin_memory, "pin_memory is on by default on a GPU"
        seen = 0
        for x, y in loader:
            assert x.device == y.device == CUDA0, (x.device, y.device)
            out = model(x)
            assert out.device == CUDA0
            optimizer.zero_grad()
            run.backward(F.mse_loss(out, y))
            assert all(p.grad is None or p.grad.device == CUDA0 for p in model.parameters())
            optimizer.step()
            seen += len(x)
        assert seen == 24 and run.step == 3
        # What the DataLoader hands over before the copy to the GPU: page-locked host memory, so
        # the loader's non_blocking copy is asynchronous. (The last epoch's plan is still loaded.)
        batches = iter(loader.dataloader)
        x, y = next(batches)
        del batches  # stops its workers now
        assert x.device.type == "cpu" and x.is_pinned() and y.is_pinned()


def test_an_explicit_pin_memory_false_is_kept():
    with ddpkit.Run(global_batch=8, progress=False) as run:
        run.setup(_model())
        assert not run.loader(_data(8), pin_memory=False).dataloader.pin_memory


def _reference(n: int, global_batch: int, seed: int) -> tuple[dict, list[float]]:
    """The same epoch as one plain CUDA loop, one step per global batch, in the run's sample order."""
    data, model = _data(n), _model().to(CUDA0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in GlobalBatchSampler(n, global_batch, 0, 1, seed=seed).epoch_batches():
        x, y = (t.to(CUDA0) for t in data[batch])
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}, losses


def test_nccl_at_world_size_1_trains_as_a_plain_cuda_loop():
    n, global_batch, seed = 44, 8, 5  # 6 steps, the last one partial (4 samples)
    with ddpkit.Run(global_batch=global_batch, seed=seed, progress=False) as run:
        assert run.env.backend == "nccl"
        model = run.setup(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        run.track(optimizer)
        losses = []
        for x, y in run.loader(_data(n)):
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            losses.append(loss.item())
        weights = {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}
    expected, expected_losses = _reference(n, global_batch, seed)
    assert len(losses) == 6
    # DDP over NCCL at world size 1 divides by 1 and sums one term, so the update is the plain
    # loop's; 1e-6 relative only allows for a different cuBLAS kernel choice.
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-6, atol=1e-7, msg=key)
