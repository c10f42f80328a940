"""The habits of a single-device script that make a step depend on the world size, each with the
switch that takes it out of a run, for ``ddpkit check`` to find which one closes a gap.

A suspect is switched off inside the check's worker (worker.py), in every process of the rerun:

- ``dropout``: ``ddpkit.Run(invariant_dropout=True)``, so that dropout masks (modules,
  ``F.dropout``, attention's ``dropout_p``) are drawn per sample;
- ``batchnorm``: every BatchNorm module kept in eval mode, normalising with its running
  statistics instead of each forward's samples;
- ``draws``: while the loop body runs (from a batch's yield to the next fetch), torch's random
  functions give their distribution's centre instead of a draw (``rand`` 0.5, ``randn`` 0,
  ``randperm(n)`` 0..n-1, ``randint`` its low end, ``bernoulli(p)`` p >= 0.5), and numpy's and
  python's global generators are seeded from the step alone, the same on every rank: a Mixup over
  the micro-batch, noise added in the loop, a per-step coin;
- ``loss``: a loss summed over the batch handed to ``run.backward`` as a mean is passed with
  ``reduction="sum"``.

Only the draws ``ddpkit.Run`` does not key are touched: ``run.randn_like`` and the dataset's
per-sample draws are left as they are.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Suspect:
    """A habit that breaks the same update, as ``ddpkit check`` names it.

    Args:
        name: the ``--suspect`` the worker takes.
        what: the habit, in the verdict's words.
        fix: the option or recipe that keeps the run the same on any world size.
        seen: words of rank 0's first-step line that says the habit is there (first_step.py);
            without that line the suspect is not rerun. None: rerun when no suspect rank 0 saw
            closes the gap (the loop's draws, which that line can miss).
    """

    name: str
    what: str
    fix: str
    seen: str | None = None


SUSPECTS = (
    Suspect(
        "dropout",
        "dropout drawn by each rank from its own generator",
        "ddpkit.Run(invariant_dropout=True) draws its masks per sample (docs/guarantees.md)",
        "drops out in",
    ),
    Suspect(
        "batchnorm",
        "BatchNorm in training mode (statistics over each forward's samples)",
        "ddpkit.Run(sync_batchnorm=True) on GPUs, GroupNorm or LayerNorm, or the BatchNorm modules "
        "in eval mode",
        "BatchNorm in training mode",
    ),
    Suspect(
        "draws",
        "draws from the global generators in the loop body or the forward (a Mixup, noise, drop-path)",
        "draw per sample with run.rand_like/run.randn_like/run.randint, or over the gathered batch "
        "(run.all_gather; docs/porting.md, Mixup)",
    ),
    Suspect(
        "loss",
        "a loss summed over the batch, weighed by run.backward as a mean",
        'run.backward(loss, reduction="sum"), or run.backward(loss, count=n) for a sum over n tokens',
        "run.backward got a loss summed",
    ),
)
NAMES = tuple(s.name for s in SUSPECTS)


def freeze_batch_norms(model: torch.nn.Module) -> None:
    """Every BatchNorm of ``model`` in eval mode at each forward, whatever ``model.train()`` set."""
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            module.register_forward_pre_hook(_in_eval)


def _in_eval(module: torch.nn.Module, args: tuple) -> None:
    module.training = False  # running statistics, not the forward's samples'


def _centre(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The centre of ``func``'s distribution in place of a draw; None: not a draw replaced here."""
    if func in (torch.rand, torch.rand_like):
        return (
            torch.full_like(args[0], 0.5)
            if func is torch.rand_like
            else torch.full(_size(args), 0.5, **kwargs)
        )
    if func in (torch.randn, torch.randn_like):
        return torch.zeros_like(args[0]) if func is torch.randn_like else torch.zeros(_size(args), **kwargs)
    if func is torch.randperm:
        return torch.arange(args[0], **kwargs)
    if func is torch.randint:
        low, size = (0, args[1]) if len(args) == 2 else (args[0], args[2])
        return torch.full(
            tuple(size), low, dtype=kwargs.get("dtype", torch.int64), device=kwargs.get("device")
        )
    if func is torch.bernoulli:
        return (args[0] >= 0.5).to(args[0].dtype)
    if func is torch.Tensor.uniform_:
        low, high = (list(args[1:]) + [0.0, 1.0][len(args) - 1 :])[:2]
        return args[0].fill_((low + high) / 2)
    if func in (torch.Tensor.normal_, torch.Tensor.bernoulli_):
        fill = args[1] if len(args) > 1 else kwargs.get("mean", 0.0 if func is torch.Tensor.normal_ else 0.5)
        return args[0].fill_(fill if func is torch.Tensor.normal_ else float(fill >= 0.5))
    return None


def _size(args: tuple) -> tuple[int, ...]:
    return (
        tuple(args[0]) if len(args) == 1 and isinstance(args[0], list | tuple | torch.Size) else tuple(args)
    )


class CentredDraws(TorchFunctionMode):
    """torch's random functions, drawn from the global generator, give their distribution's
    centre while the mode is on."""

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # A draw from a generator of its own (run.randn_like's keys) is not a global one: left alone.
        if kwargs.get("generator") is None and "out" not in kwargs:
            plain = {k: v for k, v in kwargs.items() if k != "generator"}
            if (found := _centre(func, args, plain)) is not None:
                return found
        return func(*args, **kwargs)


def seed_globals_by_step(seed: int, step: int) -> None:
    """numpy's and python's global generators from (seed, step): the same on every rank."""
    random.seed(seed * 1_000_003 + step)
    np.random.seed((seed * 1_000_003 + step) % 2**32)
