"""DataParallel's argument checks, raising the exception types torch's DDP raises for each mistake."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.parallel.bucket import FIRST_BUCKET_BYTES
from ddpkit.parallel.errors import DataParallelError

DEFAULT_BUCKET_CAP_MB = 25  # torch DDP's


def check_args(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    bucket_cap_mb: float,
    first_bucket_mb: float | None,
) -> None:
    """Fail before any collective on a mistake torch's DDP would also refuse (or ours cannot do).

    Args:
        module: the model to wrap.
        params: its parameters that DataParallel manages.
        bucket_cap_mb: the bucket cap asked for.
        first_bucket_mb: the first bucket's size asked for, or None.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "DataParallel needs a process group; call ddpkit.init_distributed() before wrapping the model"
        )
    if not bucket_cap_mb > 0:
        raise ConfigError(f"bucket_cap_mb {bucket_cap_mb} must be positive, for example bucket_cap_mb=25")
    if first_bucket_mb is not None and not first_bucket_mb > 0:
        raise ConfigError(
            f"first_bucket_mb {first_bucket_mb} must be positive (or None to pick by device), for example 1"
        )
    if not any(p.requires_grad for p in params):
        raise DataParallelError(
            f"DataParallel got a {type(module).__name__} with no parameter that requires grad; "
            "there is nothing to synchronize, so use the module without DataParallel"
        )
    _check_layers(module, params)


def _check_layers(module: nn.Module, params: Sequence[nn.Parameter]) -> None:
    sparse = [name for name, m in module.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ConfigError(
            f"DataParallel does not reduce sparse gradients, and {sparse[0]!r} makes them (sparse=True); "
            "build it with sparse=False, or train with --engine torch"
        )
    if len({p.device.type for p in params}) > 1:
        raise ConfigError(
            "DataParallel's module must be on one type of device, but its parameters are on "
            f"{sorted({str(p.device) for p in params})}; move the whole model with module.to(device)"
        )
    sync_bn = [n for n, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if sync_bn and any(p.device.type == "cpu" for p in params):
        # torch's DDP refuses this at construction too; SyncBatchNorm itself would fail at the
        # first training forward, far from the cause.
        raise ConfigError(
            f"SyncBatchNorm layers only work with GPU modules, and {sync_bn[0]!r} is on the CPU; "
            "keep nn.BatchNorm on the CPU (DataParallel broadcasts rank 0's running statistics "
            "before each forward), or train on GPUs"
        )
    for param in params:
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise DataParallelError(
                "Modules with uninitialized parameters can't be used with DataParallel; "
                "run a dummy forward pass first to initialize the lazy modules"
            )


def check_devices(params: Sequence[nn.Parameter], device_ids, output_device) -> torch.device | None:
    """The device inputs are moved to (``device_ids[0]``), or None; torch's rules and ValueErrors.

    Args:
        params: the parameters DataParallel manages.
        device_ids: None, or one device for a module on one GPU.
        output_device: None, or that device.
    """
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids can only be None or contain a single element, got {device_ids}")
    devices = {p.device for p in params}
    if not device_ids or len(devices) > 1 or next(iter(devices)).type == "cpu":
        if device_ids or output_device is not None:
            raise ValueError(
                "DataParallel device_ids and output_device arguments only work with single-device "
                f"GPU modules, but got device_ids {device_ids}, output_device {output_device}, and "
                f"module parameters {sorted(str(d) for d in devices)}; leave them out"
            )
        return None
    device = device_ids[0]
    return (
        torch.device(device)
        if not isinstance(device, int)
        else torch.device(next(iter(devices)).type, device)
    )


def warn_deprecated(check_reduction: bool, static_graph: bool, find_unused_parameters: bool) -> None:
    """torch's warnings for arguments that do nothing here."""
    if check_reduction:
        warnings.warn(
            "check_reduction is deprecated and does nothing: the reducer reports a pass that did "
            "not finish at the next forward",
            FutureWarning,
            stacklevel=3,
        )
    if static_graph and find_unused_parameters:
        warnings.warn(
            "static_graph=True finds unused parameters in its first pass, so "
            "find_unused_parameters=True is not needed (it is ignored)",
            stacklevel=3,
        )


def default_first_bucket_mb(module: nn.Module, bucket_cap_mb: float, first_bucket_mb: float | None) -> float:
    """``first_bucket_mb`` as given, or by device: bucket_cap_mb when every parameter is on the CPU."""
    if first_bucket_mb is not None:
        return first_bucket_mb
    if all(p.device.type == "cpu" for p in module.parameters()):
        return bucket_cap_mb
    return FIRST_BUCKET_BYTES / (1024 * 1024)
