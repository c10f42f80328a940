"""Capture and restore the random generators a training step draws from: python, numpy, torch.

The captured form holds only tensors, ints, floats, strings, None, lists and dicts, so it survives
``torch.load(weights_only=True)``, which refuses numpy arrays. Each rank captures its own state;
the caller gathers them (``all_gather_object``) into the checkpoint that rank 0 writes.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from ddpkit.errors import ConfigError

log = logging.getLogger(__name__)

KEYS = ("python", "numpy", "torch", "cuda")


def capture_rng() -> dict:
    """This process's generator states, in a form ``torch.save``/``torch.load(weights_only=True)`` keep.

    Returns:
        ``{"python": dict, "numpy": dict, "torch": uint8 tensor, "cuda": [uint8 tensor per GPU]}``;
        ``cuda`` is empty without CUDA.
    """
    version, internal, gauss_next = random.getstate()
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        # MT19937 words are < 2**32, so int64 tensors hold them exactly and pickle compactly.
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "bit_generator": name,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        # CPU tensors, one per visible GPU: each GPU's generator has its own seed and offset.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    """Put back generator states from ``capture_rng``; the next draws repeat those made after it.

    Tensors may sit on any device (a checkpoint loaded with ``map_location="cuda:1"``): the
    generators take them back on the CPU.

    Args:
        state: one rank's dict from ``capture_rng``, possibly after a save and load.

    Raises:
        ConfigError: ``state`` lacks a part, so it did not come from ``capture_rng``.
    """
    missing = [k for k in KEYS if k not in state] if isinstance(state, dict) else list(KEYS)
    if missing:
        raise ConfigError(f"RNG state lacks {', '.join(missing)}; pass one rank's dict from capture_rng()")
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    key = npy["key"].cpu().numpy().astype(np.uint32)
    np.random.set_state((npy["bit_generator"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    _restore_cuda(state["cuda"])


def _restore_cuda(states: list) -> None:
    if not states or not torch.cuda.is_available():
        if states:
            log.warning("checkpoint holds CUDA RNG states but CUDA is unavailable; they are not restored")
        return
    count = torch.cuda.device_count()
    if len(states) != count:
        log.warning(
            "checkpoint holds %d CUDA RNG states, this process sees %d GPUs; restoring the first %d",
            len(states),
            count,
            min(len(states), count),
        )
    for device, cuda_state in enumerate(states[:count]):
        torch.cuda.set_rng_state(cuda_state.cpu(), device)
