"""The configuration of one training run, shared by the CLI, the launcher and every worker."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields

from ddpkit.errors import ConfigError

ENGINES = ("torch",)


@dataclass(frozen=True)
class TrainConfig:
    """What ``ddpkit train`` runs. Defaults of None are filled from the workload's own defaults.

    Args:
        workload: built-in workload name: ``gpt``, ``convnet`` or ``toy``.
        steps: optimizer steps to run.
        global_batch: samples per step summed over all ranks; each rank takes global_batch / world_size.
        lr: peak learning rate (after warmup, before cosine decay).
        warmup_steps: steps of linear warmup from 0 to lr.
        seed: seeds model init, data order and sampling; the same seed gives the same run.
        out: directory for metrics.jsonl, loss.png, model.pt and config.json.
        log_every: log a metrics line every this many steps.
        backend: process-group backend: auto, gloo, nccl or mpi.
        engine: gradient-synchronization engine: ``torch`` (DistributedDataParallel).
        data: dataset path: a UTF-8 text file for gpt, an MNIST IDX directory for convnet.
        grad_clip: clip the global gradient norm to this value; 0 disables clipping.
    """

    workload: str = "gpt"
    steps: int | None = None
    global_batch: int | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    seed: int = 0
    out: str = "runs/gpt"
    log_every: int = 10
    backend: str = "auto"
    engine: str = "torch"
    data: str | None = None
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "log_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {value} is below 1; use a positive integer")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"--lr {self.lr} must be positive, for example --lr 3e-4")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown --engine {self.engine!r}; choose one of {', '.join(ENGINES)}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys are {sorted(known)}")
        return cls(**raw)

    def replace(self, **changes: object) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def check_split(global_batch: int, world_size: int) -> None:
    """Fail unless ``global_batch`` splits evenly over ``world_size`` ranks, naming the sizes that work."""
    if global_batch % world_size == 0:
        return
    works = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    raise ConfigError(
        f"--global-batch {global_batch} cannot be split evenly across {world_size} processes; "
        f"use a global batch that is a multiple of {world_size}, or a world size in {works}"
    )
