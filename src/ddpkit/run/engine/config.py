"""``EngineConfig``: how ``run.setup`` syncs, shards, recomputes and casts the model.

A leaf, as config.py (which routes ``ddpkit.Run``'s keyword options to it): it imports nothing of
the runtime; the compressions and the PowerSGD string's check come from the leaf ``ddpkit.choices``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.choices import COMPRESSIONS, powersgd_settings
from ddpkit.errors import ConfigError

ENGINES = ("torch", "native", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class EngineConfig:
    """How gradients are kept in sync, and in which precision forward runs.

    Args:
        engine: ``torch`` (DistributedDataParallel), ``native`` (ddpkit.DataParallel) or ``fsdp``
            (torch's FSDP2 ``fully_shard``: parameters, gradients and optimizer state sharded over
            the ranks; checkpoints sharded through torch.distributed.checkpoint; docs/fsdp.md).
        bucket_cap_mb: gradient bucket size in MiB (both engines).
        find_unused_parameters: reduce zeros for parameters a forward did not use. Without it,
            a backward pass that leaves some out stops the next forward with one line naming them.
        compression: None, ``bf16``, ``fp16``, ``powersgd`` (rank 1, torch's) or
            ``powersgd:RANK[:START_ITER]`` gradient compression (both engines; ``powersgd:8``
            keeps the bench GPT's loss within 3.5% of uncompressed over 3 seeds, see docs/engine.md).
        sync_batchnorm: turn BatchNorm layers into SyncBatchNorm (GPUs only: torch refuses CPU).
        broadcast_buffers: copy rank 0's buffers to every rank before each forward.
        precision: ``fp32``, ``bf16`` (autocast; on fsdp: bf16 parameters in compute, fp32
            reductions and master weights) or ``fp16`` (autocast and a GradScaler, GPU only).
        shard_modules: fsdp: the class names of the modules that each get their own
            ``fully_shard`` (``Block``); empty: the default policy of docs/fsdp.md.
        reshard_after_forward: fsdp: free the gathered parameters after each block's forward and
            gather them again for backward (ZeRO-3, least memory); False keeps them until backward.
        invariant_dropout: dropout-like modules (``nn.Dropout*``, ``drop_prob`` as timm's
            DropPath) draw their masks per sample from (seed, step, the sample's place in the
            global batch): the same on any world size and micro_batch (run/invariant/dropout.py).
        dropout_batch_dim: the batch dimension of dropout's inputs (1 for ``nn.Transformer``
            without ``batch_first``).
        checkpoint_modules: the class names of the modules whose activations are not kept but
            recomputed in backward (activation checkpointing: torch.utils.checkpoint,
            non-reentrant, the random state replayed), on every engine (``Block``).
        offload: fsdp on GPUs: keep parameters, gradients and optimizer state in host memory
            (FSDP2's CPUOffloadPolicy), so one GPU trains a model larger than its memory.
    """

    engine: str = "torch"
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    compression: str | None = None
    sync_batchnorm: bool = False
    broadcast_buffers: bool = True
    precision: str = "fp32"
    shard_modules: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    invariant_dropout: bool = False
    dropout_batch_dim: int = 0
    checkpoint_modules: tuple[str, ...] = ()
    offload: bool = False

    def __post_init__(self) -> None:
        choose("engine", self.engine, ENGINES)
        choose("precision", self.precision, PRECISIONS)
        if not isinstance(self.shard_modules, list | tuple):
            raise ConfigError(
                f"shard_modules={self.shard_modules!r} must be a list of class names, like ['Block']"
            )
        object.__setattr__(self, "shard_modules", tuple(self.shard_modules))  # frozen: set once here
        if not isinstance(self.checkpoint_modules, list | tuple):
            raise ConfigError(
                f"checkpoint_modules={self.checkpoint_modules!r} must be a list of class names, "
                "like ['Block']"
            )
        object.__setattr__(self, "checkpoint_modules", tuple(self.checkpoint_modules))
        if self.offload and self.engine != "fsdp":
            raise ConfigError(
                "offload=True keeps a sharded model's state in host memory; it needs engine='fsdp', "
                f"not {self.engine!r}"
            )
        if self.engine == "fsdp":
            _check_fsdp(self)
        if isinstance(self.compression, str) and self.compression.startswith("powersgd:"):
            powersgd_settings(self.compression)  # a bad rank or start is one line, here
        else:
            choose("compression", self.compression, (None, *COMPRESSIONS))
        if not self.bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb={self.bucket_cap_mb} must be positive, for example 25")


def _check_fsdp(cfg: EngineConfig) -> None:
    """What FSDP2 has no counterpart for: DDP's gradient compression hooks, the fp16 GradScaler."""
    if cfg.compression is not None:
        raise ConfigError(
            f"compression={cfg.compression!r} is a DDP communication hook, which engine='fsdp' has not; "
            "leave compression unset, or use engine='native'"
        )
    if cfg.precision == "fp16" or cfg.sync_batchnorm:
        what = "precision='fp16'" if cfg.precision == "fp16" else "sync_batchnorm=True"
        raise ConfigError(
            f"{what} is not supported with engine='fsdp'; use precision='bf16' / plain BatchNorm"
        )


def choose(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name}={value!r}; choose one of {', '.join(map(repr, allowed))}")
