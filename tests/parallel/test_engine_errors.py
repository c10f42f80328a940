"""Each mistake raises the exception type torch's DDP raises for it, so code that catches torch's
errors catches ours; the CLI still sees a ConfigError where the user can fix it. Run on a world
of one, in this process, for both engines side by side."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddpkit import ConfigError, DataParallel

ENGINES = [DistributedDataParallel, DataParallel]


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.idle = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("engine", ENGINES)
def test_no_trainable_parameter_is_a_runtime_error(world_of_one, engine) -> None:
    with pytest.raises(RuntimeError):
        engine(nn.Linear(2, 2).requires_grad_(False))


def test_no_trainable_parameter_is_still_a_config_error(world_of_one) -> None:
    with pytest.raises(ConfigError, match="no parameter that requires grad"):
        DataParallel(nn.Module())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_parameter_without_gradient_fails_the_next_forward(world_of_one, engine) -> None:
    model = engine(TwoHeads())
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="idle" if engine is DataParallel else "finished reduction"):
        model(torch.randn(2, 4))


@pytest.mark.parametrize("engine", ENGINES)
def test_comm_hook_mistakes(world_of_one, engine) -> None:
    model = engine(nn.Linear(2, 2))
    with pytest.raises(TypeError):
        model.register_comm_hook(None, "allreduce")

    def annotated(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
        return default_hooks.allreduce_hook(state, bucket)

    with pytest.raises(ValueError, match="GradBucket"):
        model.register_comm_hook(None, annotated)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)


@pytest.mark.parametrize("engine", ENGINES)
def test_sync_batchnorm_on_cpu_is_refused_at_construction(world_of_one, engine) -> None:
    with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
        engine(nn.Sequential(nn.Linear(2, 4), nn.SyncBatchNorm(4)))


@pytest.mark.parametrize("engine", ENGINES)
def test_device_ids_for_a_cpu_module(world_of_one, engine) -> None:
    with pytest.raises(ValueError, match="device_ids"):
        engine(nn.Linear(2, 2), device_ids=[0])


@pytest.mark.parametrize("engine", ENGINES)
def test_pickling_needs_the_default_group(world_of_one, engine) -> None:
    model = engine(nn.Linear(2, 2), process_group=dist.new_group([0]))
    with pytest.raises(RuntimeError, match="default process group"):
        torch.save(model, io.BytesIO())


def test_pickled_model_keeps_its_settings(world_of_one) -> None:
    model = DataParallel(nn.Linear(2, 2), find_unused_parameters=True, gradient_as_bucket_view=False)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.find_unused_parameters and not loaded.gradient_as_bucket_view
    assert loaded.reducer.params == list(loaded.module.parameters())
    loaded(torch.randn(3, 2)).sum().backward()
    assert all(p.grad is not None for p in loaded.module.parameters())
