"""What the built-in Trainer adds to a Run: the task, the default optimizer and schedule, evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddpkit.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    """The Trainer's own settings; everything else a ``ddpkit train`` job sets belongs to the Run.

    Args:
        task: a built-in workload (gpt, convnet, toy), a file path/to/task.py, or
            package.module:function; either defines build(cfg) returning ddpkit.Task.
        data: the built-in workloads' data: a UTF-8 text file (gpt) or an MNIST IDX folder
            (convnet); None uses the bundled data. Task files read their own.
        epochs: passes over the data, when steps is not set (neither set: one epoch).
        lr: peak learning rate of the default AdamW and schedule (a task's own optimizer ignores it).
        warmup_steps: steps of linear warmup in the default schedule, before cosine decay to lr / 10.
        weight_decay: the default AdamW's weight decay on matrices (biases and norms get none).
        eval_every: evaluate on the held-out split every this many steps and at the end; 0 disables.
        num_workers: DataLoader worker processes per rank that load and collate the batches;
            they persist across epochs.
    """

    task: str = "gpt"
    data: str | None = None
    epochs: int | None = None
    lr: float = 1e-3
    warmup_steps: int = 0
    weight_decay: float = 0.1
    eval_every: int = 0
    num_workers: int = 0

    def __post_init__(self) -> None:
        if not self.task:
            raise ConfigError("task='' names nothing; give gpt, convnet, toy, a task file or module:build")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"epochs={self.epochs} is below 1; use a positive number of passes")
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr={self.lr} must be a finite positive number, for example 3e-4")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay={self.weight_decay} must be finite and >= 0, for example 0.1")
        for name in ("warmup_steps", "eval_every", "num_workers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} is below 0; use 0 or more")
