"""How ``Run.setup`` places and wraps a model: torch's DDP or ddpkit's DataParallel, and precision.

One function decides it, from one frozen ``EngineConfig``. The wrapped model is what the user
calls; ``unwrap`` gives the bare module whose ``state_dict`` goes into checkpoints (inside the
engine and any ``torch.compile``, so its keys are the plain model's in either order of the two).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.parallel import DataParallel
from ddpkit.parallel.compression import parse_powersgd
from ddpkit.parallel.errors import DataParallelError
from ddpkit.parallel.sync import broadcast_coalesced
from ddpkit.run.config import EngineConfig
from ddpkit.run.sharded import is_sharded, set_sync, shard


def wrap(model: nn.Module, env: DistEnv, cfg: EngineConfig) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in the engine; rank 0's weights win.

    Raises:
        ConfigError: fp16 or SyncBatchNorm on a CPU, or a model without trainable parameters.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"run.setup takes an nn.Module, got {type(model).__name__}")
    if env.device.type != "cuda" and (cfg.precision == "fp16" or cfg.sync_batchnorm):
        what = "precision='fp16' (a GradScaler)" if cfg.precision == "fp16" else "sync_batchnorm=True"
        raise ConfigError(f"{what} needs GPUs (torch refuses it on CPU); leave it off, or use bf16 on CPU")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{type(model).__name__} has no parameter that requires grad; nothing to train")
    model = model.to(env.device)
    if cfg.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    trainable = tuple(p.requires_grad for p in model.parameters())  # what the engine will sync
    engines = {"native": _native, "fsdp": shard, "torch": _torch_ddp}
    wrapped = engines[cfg.engine](model, env, cfg)
    wrapped.ddpkit_trainable = trainable
    if cfg.precision != "fp32" and cfg.engine != "fsdp":  # fsdp's precision is its own policy
        dtype = torch.float16 if cfg.precision == "fp16" else torch.bfloat16
        # An instance attribute shadows the class's forward: nn.Module.__call__ calls self.forward.
        wrapped.forward = _autocast_forward(wrapped.forward, env.device.type, dtype)
    return wrapped


def _native(model: nn.Module, env: DistEnv, cfg: EngineConfig) -> DataParallel:
    return _NativeEngine(
        model,
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
        forward_sync_buffers=cfg.broadcast_buffers,  # as for torch's: buffers are synced at start either way
        compression=cfg.compression,
    )


def _torch_ddp(model: nn.Module, env: DistEnv, cfg: EngineConfig) -> DistributedDataParallel:
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers and warns about the old name.
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    ddp = _TorchEngine(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
        **{"forward_sync_buffers" if renamed else "broadcast_buffers": cfg.broadcast_buffers},
    )
    if cfg.compression is not None:
        ddp.register_comm_hook(*_torch_hook(cfg.compression))
    return ddp


# torch's DDP raises this at the forward after a backward pass in which some parameters got no
# gradient, and numbers them (not by name unless TORCH_DISTRIBUTED_DEBUG is set).
_UNFINISHED = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


class _NamesUnused:
    """An engine whose error for parameters that got no gradient in the last backward pass is
    one line naming them and the fix in ``ddpkit.Run``'s terms (torch's numbers them and names
    DDP's keyword), and which gives the user's attributes and methods (``model.backbone``,
    ``model.generate``) as the user's own model does (Lightning Fabric's wrapper does the same)."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # nn.Module's: the engine's parameters, buffers, children
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:  # not wrapped yet (the engine's own constructor looking)
                raise
            return getattr(module, name)

    def forward(self, *inputs, **kwargs):
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            names = _unused_names(exc, self)
            if names is None:
                raise
            raise _unused_error(names, type(unwrap(self)).__name__) from None

    def _get_name(self) -> str:  # print(model) shows the engine's own class name
        return next(c.__name__ for c in type(self).__mro__ if c in (DistributedDataParallel, DataParallel))


class _TorchEngine(_NamesUnused, DistributedDataParallel):
    """torch's DistributedDataParallel, naming parameters without a gradient."""


class _NativeEngine(_NamesUnused, DataParallel):
    """ddpkit's DataParallel, naming parameters without a gradient in Run's terms."""


def _unused_names(exc: RuntimeError, model: nn.Module) -> list[str] | None:
    """The parameters ``exc`` says got no gradient, by name; None if it says something else."""
    if isinstance(exc, DataParallelError) and hasattr(exc, "missing"):  # the native engine's names
        return [_plain_name(name) for name in exc.missing]
    text = str(exc)
    if _UNFINISHED not in text:
        return None
    found = _INDICES.search(text)
    if found is None:
        return []
    names = _torch_param_names(model)
    return [names[int(i)] for i in found[1].split() if int(i) < len(names)]


def _torch_param_names(ddp: DistributedDataParallel) -> list[str]:
    """The names of the parameters torch's DDP numbers, in its order: ``_build_params_for_reducer``
    takes each module's own parameters (``named_modules`` order) that require grad and are not
    ignored, each parameter once."""
    ignored, seen, names = getattr(ddp, "parameters_to_ignore", set()), set(), []
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}"  # torch's key, "." first for the root's own
            if param.requires_grad and full not in ignored and id(param) not in seen:
                seen.add(id(param))
                names.append(_plain_name(full.lstrip(".")))
    return names


def _plain_name(name: str) -> str:
    """A parameter's name in the model the user built: without torch.compile's ``_orig_mod.``."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _unused_error(names: list[str], model: str) -> DataParallelError:
    listed = ", ".join(map(repr, names[:8])) + (" ..." if len(names) > 8 else "")
    which = f"{len(names)} parameter(s) of {model} ({listed})" if names else f"parameters of {model}"
    return DataParallelError(
        f"{which} got no gradient in the last backward pass; pass "
        "ddpkit.Run(find_unused_parameters=True) if the forward leaves them out, or freeze them "
        "before run.setup with requires_grad_(False) if they are never trained"
    )


def _torch_hook(name: str) -> tuple:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name.startswith("powersgd"):
        ours = parse_powersgd(name)  # the same rank and plain steps as the native engine's
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=ours.matrix_approximation_rank,
            start_powerSGD_iter=ours.start_iter,
        )
        return state, powerSGD_hook.powerSGD_hook
    return None, default_hooks.bf16_compress_hook if name == "bf16" else default_hooks.fp16_compress_hook


def _autocast_forward(forward, device_type: str, dtype: torch.dtype):
    """Run ``forward`` under autocast and hand back float32 outputs, so a loss outside is fp32."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            output = forward(*args, **kwargs)
        return _to_float32(output)

    return run


def _to_float32(value):
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, dict):
        return type(value)({k: _to_float32(v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_float32(v) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_to_float32(v) for v in value)
    return value


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module inside the engine and ``torch.compile`` wrappers, in any order (the model
    itself when not wrapped): its ``state_dict`` keys are the plain model's, without ``_orig_mod.``."""
    # A compiled module exists only once torch._dynamo is imported; importing it here would cost
    # every script a second at start-up.
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", ())
    while True:
        if isinstance(model, DistributedDataParallel | DataParallel):
            model = model.module
        elif compiled and isinstance(model, compiled):
            model = model._orig_mod
        else:
            return model


def set_grad_sync(models: Iterable[nn.Module], sync: bool) -> None:
    """What ``no_sync()`` toggles, for several models at once: False accumulates locally."""
    for model in models:
        if is_sharded(model):
            set_sync(model, sync)
            continue
        # Set only on a change: nn.Module.__setattr__ is slow, and most steps are one micro-batch.
        if model.require_backward_grad_sync != sync:
            model.require_backward_grad_sync = sync


@contextlib.contextmanager
def local_forwards(models: list[nn.Module]) -> Iterator[None]:
    """Forwards that start no collective, for ranks running unequal numbers of eval batches.

    Rank 0's buffers (BatchNorm statistics) are broadcast once first, as the engines would do
    at the next forward; then forward-time buffer syncs are off until the context ends.
    """
    saved = []
    for model in models:
        broadcast_coalesced(list(unwrap(model).buffers()), dist.group.WORLD, 0)
        # The flag each engine reads before a forward to decide whether to sync buffers.
        flag = "sync_buffers_next" if isinstance(model, DataParallel) else "require_forward_param_sync"
        saved.append((model, flag, getattr(model, flag, True)))  # fsdp: our hook reads it
        setattr(model, flag, False)
    try:
        yield
    finally:
        for model, flag, value in saved:
            setattr(model, flag, value)


class TrainableCheck:
    """The parameters each engine syncs are those trainable when ``run.setup`` wrapped the model:
    torch's DDP leaves a parameter frozen then out of its buckets for good, so unfreezing it later
    (``if epoch == 1: backbone.requires_grad_(True)``) would let the replicas drift, and freezing
    one makes a backward without its gradient. Checked at each step's start; one line names it."""

    def __init__(self, models: dict[str, nn.Module]) -> None:
        self.models = models

    def check(self, step: int) -> None:
        for name, model in self.models.items():
            params = list(unwrap(model).named_parameters())
            now, was = tuple(p.requires_grad for _, p in params), model.ddpkit_trainable
            if now != was:
                changed = next(n for (n, _), a, b in zip(params, was, now, strict=True) if a != b)
                what = "became trainable" if dict(params)[changed].requires_grad else "was frozen"
                raise ConfigError(
                    f"step {step}: {changed!r} of {name!r} {what} after run.setup, and the engine syncs the "
                    "parameters trainable when it wrapped the model (replicas would drift); set "
                    "requires_grad before run.setup and hold a parameter still with its learning rate "
                    "(param_group['lr'] = 0) instead"
                )
