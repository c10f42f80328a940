"""Checkpoints: atomic save, verified load, retention of the last K, and RNG state capture."""

from ddpkit.checkpoint.choose import load_latest, newest_good, resolve_resume
from ddpkit.checkpoint.files import DiskFullError
from ddpkit.checkpoint.manifest import verify_checkpoint
from ddpkit.checkpoint.rng import capture_rng, restore_rng
from ddpkit.checkpoint.store import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "DiskFullError",
    "capture_rng",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "newest_good",
    "resolve_resume",
    "restore_rng",
    "save_checkpoint",
    "verify_checkpoint",
]
