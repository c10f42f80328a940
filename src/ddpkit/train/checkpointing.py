"""What a Trainer puts in a checkpoint, and how it continues from one.

A checkpoint holds everything that decides the rest of the run: model, optimizer, grad scaler,
sampler position, step, the schedule's parameters, and every rank's RNG states. Only rank 0
writes; every rank loads the same file onto its own device and then proves, with a fingerprint
all-gather, that all replicas agree.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from ddpkit.checkpoint import capture_rng, load_checkpoint, resolve_resume, restore_rng, save_checkpoint
from ddpkit.diagnostics import check_replicas_agree

if TYPE_CHECKING:
    from ddpkit.train.trainer import Trainer

log = logging.getLogger(__name__)


def checkpoint_dir(trainer: Trainer) -> Path:
    return trainer.out / "checkpoints"


def state_of(trainer: Trainer) -> dict:
    """The checkpoint contents. Collective: every rank must call it (RNG states are gathered)."""
    rng = [None] * trainer.env.world_size
    dist.all_gather_object(rng, capture_rng())
    cfg = trainer.cfg
    return {
        "step": trainer.step,
        "model": trainer.model.module.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "sampler": trainer.sampler.state_dict(),
        "schedule": {
            "name": "warmup_cosine",
            "lr": cfg.lr,
            "warmup_steps": cfg.warmup_steps,
            "total_steps": trainer.total_steps,
        },
        "rng": rng,
        "world_size": trainer.env.world_size,
    }


def save(trainer: Trainer) -> None:
    """Checkpoint the current step; all ranks call it, rank 0 writes."""
    state = state_of(trainer)
    if trainer.env.is_rank0:
        path = save_checkpoint(checkpoint_dir(trainer), trainer.step, state, keep_last=trainer.cfg.keep_last)
        log.info("saved %s", path)


def maybe_resume(trainer: Trainer) -> None:
    """Load the checkpoint that ``cfg.resume`` names, if any; rank 0 decides which, all load it."""
    choice = [None]
    if trainer.env.is_rank0:
        found = resolve_resume(checkpoint_dir(trainer), trainer.cfg.resume)
        choice = [str(found) if found else None]
    # Rank 0 picks, so every rank loads the same checkpoint even if a newer one appears meanwhile.
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return
    state = load_checkpoint(choice[0], map_location=trainer.env.device)
    restore(trainer, state)
    check_replicas_agree(trainer.model.module, trainer.env, f"after loading {choice[0]}")
    if trainer.env.is_rank0:
        print(f"ddpkit: resumed from {choice[0]} at step {trainer.step}", flush=True)


def restore(trainer: Trainer, state: dict) -> None:
    """Put a loaded checkpoint's state into the trainer on this rank."""
    trainer.model.module.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scaler.load_state_dict(state["scaler"])
    trainer.sampler.load_state_dict(state["sampler"])
    trainer.step = state["step"]
    rng = state["rng"]
    # Same world size: each rank continues its own random streams; otherwise ranks map modulo.
    restore_rng(rng[trainer.env.rank % len(rng)])
