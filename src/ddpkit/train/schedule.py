"""Learning-rate schedule: linear warmup, then cosine decay to a tenth of the peak."""

from __future__ import annotations

import math

import torch


def warmup_cosine(
    step: int, peak_lr: float, warmup_steps: int, total_steps: int, floor: float = 0.1
) -> float:
    """Learning rate for 1-based ``step``.

    Args:
        step: the step about to run, 1 .. total_steps.
        peak_lr: learning rate at the end of warmup.
        warmup_steps: steps of linear increase from peak_lr / warmup_steps to peak_lr.
        total_steps: the last step; the rate reaches floor * peak_lr there.
        floor: final rate as a fraction of the peak.
    """
    if step <= warmup_steps:
        return peak_lr * step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``warmup_cosine`` as an LR scheduler over the optimizer's own rates, stepped once per step.

    LambdaLR applies factor(0) before the first step and factor(k) after k steps, so step k + 1
    runs at ``warmup_cosine(k + 1, ...)``, as the rate for 1-based steps should.
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: warmup_cosine(k + 1, 1.0, warmup_steps, total_steps)
    )
