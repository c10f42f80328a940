"""The configuration of one training run, shared by the CLI, the launcher and every worker."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields

from ddpkit.errors import ConfigError

ENGINES = ("torch", "native")
PRECISIONS = ("fp32", "bf16", "fp16")


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
        engine: gradient-synchronization engine: ``torch`` (DistributedDataParallel) or ``native``
            (ddpkit.DataParallel).
        data: dataset path: a UTF-8 text file for gpt, an MNIST IDX directory for convnet.
        grad_clip: clip the global gradient norm to this value; 0 disables clipping.
        micro_batch: samples per forward/backward on one rank; smaller than the rank's share of the
            global batch means gradient accumulation (under no_sync). None: the whole share at once.
        epochs: run this many passes over the data instead of ``steps``.
        precision: fp32, bf16 (autocast on CPU and GPU) or fp16 (autocast with a GradScaler, GPU only).
        weight_decay: AdamW weight decay on matrices.
        save_every: write a checkpoint every this many steps (and at the end); 0 disables.
        keep_last: checkpoints to keep.
        resume: ``never``, ``auto`` (newest good checkpoint in OUT/checkpoints) or a checkpoint path.
        eval_every: evaluate on the held-out split every this many steps (and at the end); 0 disables.
        log_samples: each rank writes OUT/samples/rank{R}.jsonl with the dataset indices of each step.
        drop_last: skip each epoch's final partial global batch.
        check_every: every this many steps, all ranks compare parameter fingerprints; 0 disables.
        on_nonfinite: what a non-finite gradient does: ``stop`` the run, or ``skip`` the step.
        collective_timeout: seconds a rank may go without progress in a collective before ddpkit
            reports which ranks are behind, prints every rank's stack and stops the run; 0 disables.
            Generous by default: slow ranks (the seeds' skewed processing speeds) are not hangs.
        rank_table_every: rank 0 logs a table of every rank's timings this often; 0 disables
            (stragglers are warned about at every log step regardless).
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
    micro_batch: int | None = None
    epochs: int | None = None
    precision: str = "fp32"
    weight_decay: float = 0.1
    save_every: int = 0
    keep_last: int = 2
    resume: str = "never"
    eval_every: int = 0
    log_samples: bool = False
    drop_last: bool = False
    check_every: int = 100
    on_nonfinite: str = "stop"
    rank_table_every: int = 0
    collective_timeout: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "log_every", "micro_batch", "epochs", "keep_last"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {value} is below 1; use a positive integer")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"--lr {self.lr} must be positive, for example --lr 3e-4")
        if self.collective_timeout < 0:
            raise ConfigError(f"--collective-timeout {self.collective_timeout} is below 0; use 0 to disable")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"--on-nonfinite {self.on_nonfinite!r} must be stop or skip")
        for name in ("save_every", "eval_every", "check_every", "rank_table_every"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} is below 0; use 0 to disable"
                )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"unknown --precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
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


# Fields that define which run this is: a resume with any of them changed would be another run.
RUN_IDENTITY = (
    "workload",
    "global_batch",
    "seed",
    "lr",
    "warmup_steps",
    "data",
    "micro_batch",
    "precision",
    "weight_decay",
    "grad_clip",
    "drop_last",
)


def check_same_run(saved: TrainConfig, current: TrainConfig) -> None:
    """Refuse to resume a run under settings that would make it a different run."""
    for name in RUN_IDENTITY:
        before, now = getattr(saved, name), getattr(current, name)
        if before != now:
            raise ConfigError(
                f"--resume: the run in {current.out!r} has {name}={before!r} but this command gives {now!r}; "
                f"use the same {name}, or --overwrite / another --out for a new run"
            )


def check_split(global_batch: int, world_size: int) -> None:
    """Fail unless ``global_batch`` splits evenly over ``world_size`` ranks, naming the sizes that work."""
    if global_batch % world_size == 0:
        return
    works = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    raise ConfigError(
        f"--global-batch {global_batch} cannot be split evenly across {world_size} processes; "
        f"use a global batch that is a multiple of {world_size}, or a world size in {works}"
    )
