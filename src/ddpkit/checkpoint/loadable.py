"""Whether a state file loads with ``torch.load(weights_only=True)``, the only way ddpkit loads one.

A checkpoint whose manifest matches can still hold a pickle that weights_only refuses (written by
another tool, or crafted: its globals would run code under a plain ``torch.load``). The save checks
this so a bad state fails at once rather than at a resume hours later; ``--resume auto`` checks it
so such a checkpoint is skipped like any other corrupt one.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch


def weights_only_problem(path: Path) -> str | None:
    """Why ``torch.load(path, weights_only=True)`` refuses the file, or None when it loads.

    Only the pickle is read (``mmap``): the tensors' bytes stay on disk, so this is cheap for a
    large checkpoint.
    """
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        return f"torch.load(weights_only=True) refuses it: {weights_only_reason(exc)}"
    except RuntimeError as exc:  # not a torch zip file at all
        return f"torch.load cannot read it: {str(exc).splitlines()[0]}"
    return None


def weights_only_reason(exc: Exception) -> str:
    """The first sentence of torch's weights_only error, without its advice to trust the file."""
    text = str(exc)
    marker = "WeightsUnpickler error: "
    if marker in text:
        text = text.split(marker, 1)[1]
    return text.split(". Please", 1)[0].split("\n", 1)[0]
