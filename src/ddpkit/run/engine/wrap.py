"""How ``Run.setup`` places and wraps a model: torch's DDP or ddpkit's DataParallel, and precision.

One function decides it, from one frozen ``EngineConfig``. The wrapped model is what the user
calls; ``unwrap`` gives the bare module whose ``state_dict`` goes into checkpoints (inside the
engine and any ``torch.compile``, so its keys are the plain model's in either order of the two).
"""

from __future__ import annotations

import contextlib
import inspect
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
from ddpkit.parallel.sync import broadcast_coalesced, call_module, eager
from ddpkit.run.config import EngineConfig
from ddpkit.run.engine.errors import trainable_error, unused_error, unused_names
from ddpkit.run.engine.fsdp import is_sharded, set_sync, shard
from ddpkit.run.engine.local import LocalEngine
from ddpkit.run.engine.materialize import has_meta
from ddpkit.run.engine.precision import autocast_forward
from ddpkit.run.engine.recompute import checkpoint_modules
from ddpkit.run.invariant.draws import SampleDraws
from ddpkit.run.step_state import StepState


def _check_cpu(cfg: EngineConfig) -> None:
    """Refuse, on a CPU, what torch only does on GPUs, naming what a CPU run does instead."""
    if cfg.precision == "fp16":
        raise ConfigError(
            "precision='fp16' (a GradScaler) needs GPUs (torch refuses it on CPU); "
            "leave it off, or use bf16 on CPU"
        )
    if cfg.sync_batchnorm:
        raise ConfigError(
            "sync_batchnorm=True needs GPUs (torch's SyncBatchNorm refuses CPU tensors); on CPU use "
            "GroupNorm or LayerNorm instead of BatchNorm, freeze the BatchNorm statistics (model.eval() "
            "on the BN modules), or leave sync_batchnorm off and accept per-rank batch statistics"
        )


def wrap(
    model: nn.Module,
    env: DistEnv,
    cfg: EngineConfig,
    draws: SampleDraws | None = None,
    state: StepState | None = None,
) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in the engine; rank 0's weights win.

    ``state`` is the run's step state, which the wrapper reads to tell a change of
    ``requires_grad`` between steps from one inside a step (without one: always between steps).

    Raises:
        ConfigError: fp16 or SyncBatchNorm on a CPU, or a model without trainable parameters.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"run.setup takes an nn.Module, got {type(model).__name__}")
    if env.device.type != "cuda":
        _check_cpu(cfg)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{type(model).__name__} has no parameter that requires grad; nothing to train")
    if cfg.offload and env.device.type != "cuda":
        raise ConfigError(
            "offload=True moves a sharded model's state off the GPU; on a CPU it is there already"
        )
    # A meta model on fsdp gets its storage once sharded (materialize.py); an offloaded one
    # stays in host memory, where FSDP2 keeps its shards.
    if not has_meta(model) and not cfg.offload:
        model = model.to(env.device)
    checkpoint_modules(model, cfg.checkpoint_modules, draws)
    if cfg.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    trainable = tuple(p.requires_grad for p in model.parameters())  # what the engine will sync
    engines = {"native": _native, "fsdp": shard, "torch": _TorchEngine}
    alone = env.world_size == 1 and cfg.engine != "fsdp" and cfg.compression is None
    state = state or StepState()
    wrapped = (
        _Local(model, cfg.find_unused_parameters, state) if alone else engines[cfg.engine](model, env, cfg)
    )
    if isinstance(wrapped, _RunEngine):  # fsdp's model follows requires_grad by itself
        wrapped.follow(state, trainable)
    if cfg.precision != "fp32" and cfg.engine != "fsdp":  # fsdp's precision is its own policy
        dtype = torch.float16 if cfg.precision == "fp16" else torch.bfloat16
        # An instance attribute shadows the class's forward: nn.Module.__call__ calls self.forward.
        wrapped.forward = autocast_forward(wrapped.forward, env.device.type, dtype)
    return wrapped


def _native(model: nn.Module, env: DistEnv, cfg: EngineConfig) -> DataParallel:
    return _NativeEngine(
        model,
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
        forward_sync_buffers=cfg.broadcast_buffers,  # as for torch's: buffers are synced at start either way
        compression=cfg.compression,
    )


class _RunEngine:
    """What ``run.setup`` returns, on either engine: it re-plans the engine when ``requires_grad``
    changes between steps (``_follow_trainable``), names the parameters that got no gradient in
    the last backward pass in one line with the fix in ``ddpkit.Run``'s terms (torch numbers them
    and names DDP's keyword), and gives the user's attributes and methods (``model.backbone``,
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
        if torch.is_grad_enabled() and not self._follow_trainable():
            # Every parameter frozen (a GAN's discriminator in the generator's pass): a plain
            # forward, which prepares no all-reduce for gradients none of them will get.
            return call_module(self.module, *inputs, **kwargs)
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            names = unused_names(exc, self)
            if names is None:
                raise
            raise unused_error(names, type(unwrap(self)).__name__) from None

    def follow(self, state: StepState, trainable: tuple[bool, ...]) -> None:
        """Read the run's step ``state`` from here on; ``trainable`` is what the engine syncs now."""
        # Plain attributes, set in __dict__: nn.Module's __setattr__ costs microseconds a step.
        self.__dict__.update(_run_state=state, _run_trainable=trainable, _run_forward_step=None)
        self.__dict__["_run_params"] = list(self.module.parameters())  # read every forward: made once

    @eager
    def _follow_trainable(self) -> bool:
        """Re-plan the engine when what requires grad changed since the last training forward.

        Each engine syncs the parameters trainable when it was built: a backbone frozen before
        ``run.setup`` and unfrozen at epoch 1 (the fine-tuning recipe) would otherwise never be
        synced, and the replicas drift. Every rank runs the same loop, so every rank re-plans at
        the same forward. A change in the middle of a step (after its first forward) would leave
        the step's earlier micro-batches out of the new parameters' gradients: one line instead.
        """
        # Between steps, or this step's first training forward: a change is the user's freezing
        # or unfreezing after an epoch or before a step; later in a step it is not.
        step = self._run_state.step if self._run_state.open else None
        first = step is None or step != self._run_forward_step
        self.__dict__["_run_forward_step"] = step
        now = tuple(p.requires_grad for p in self._run_params)
        if now == self._run_trainable:
            return True
        if not any(now):
            return False  # nothing to sync; a backward with nothing trainable is run.backward's line
        model = type(unwrap(self)).__name__
        if not first:
            raise trainable_error(self.module, self._run_trainable, model, step)
        self.replan()
        self.__dict__["_run_trainable"] = now
        where = "between steps" if step is None else f"step {step}"
        if dist.get_rank() == 0:
            print(
                f"ddpkit: {where}: {model} now trains {sum(now)} of {len(now)} "
                "parameters (requires_grad changed); the engine syncs those from here on",
                flush=True,
            )
        return True

    def _get_name(self) -> str:  # print(model) shows the engine's own class name
        return next(c.__name__ for c in type(self).__mro__ if c in (DistributedDataParallel, DataParallel))


class _TorchEngine(_RunEngine, DistributedDataParallel):
    """torch's DistributedDataParallel, naming parameters without a gradient."""

    def __init__(self, model: nn.Module, env: DistEnv, cfg: EngineConfig, init_sync: bool = True) -> None:
        # torch 2.13 renamed broadcast_buffers to forward_sync_buffers and warns about the old name;
        # init_sync (skip the constructor's collectives) came in late 2024: older ones always sync.
        known = inspect.signature(DistributedDataParallel).parameters
        renamed = "forward_sync_buffers" in known
        sync = {"init_sync": init_sync} if "init_sync" in known else {}
        super().__init__(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_cap_mb,
            find_unused_parameters=cfg.find_unused_parameters,
            **sync,
            **{"forward_sync_buffers" if renamed else "broadcast_buffers": cfg.broadcast_buffers},
        )
        if cfg.compression is not None:
            self.register_comm_hook(*_torch_hook(cfg.compression))
        self._run_rebuild = (env, cfg)

    def replan(self) -> None:
        """torch's DDP takes its parameters once, in its constructor: built again in place (the
        user holds this object), it buckets those trainable now, and the old reducer goes with
        its hooks. No collective (the replicas agree already; a rank that got here alone, as in a
        desync, must wait in the next all-reduce, where the hang reports find it). The no_sync
        state is this step's and stays."""
        sync = self.require_backward_grad_sync, self.require_forward_param_sync
        _TorchEngine.__init__(self, self.module, *self._run_rebuild, init_sync=False)
        self.require_backward_grad_sync, self.require_forward_param_sync = sync


class _NativeEngine(_RunEngine, DataParallel):
    """ddpkit's DataParallel, naming parameters without a gradient in Run's terms."""


class _Local(_RunEngine, LocalEngine):
    """A world of one: the model called directly (local.py), with the engine's checks."""

    def _get_name(self) -> str:
        return "LocalEngine"


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


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module inside the engine and ``torch.compile`` wrappers, in any order (the model
    itself when not wrapped): its ``state_dict`` keys are the plain model's, without ``_orig_mod.``."""
    # A compiled module exists only once torch._dynamo is imported; importing it here would cost
    # every script a second at start-up.
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", ())
    while True:
        if isinstance(model, DistributedDataParallel | DataParallel | LocalEngine):
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
