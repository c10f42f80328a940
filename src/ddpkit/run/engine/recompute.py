"""``checkpoint_modules=["Block"]``: activation checkpointing, the same results with less memory.

Each chosen module's forward runs under torch's ``torch.utils.checkpoint`` (non-reentrant): its
activations are freed after the forward and recomputed in the backward. torch replays the
random state for the recomputation (``preserve_rng_state``), so ``nn.Dropout`` draws the same
mask twice. ddpkit's keyed draws (``invariant_dropout``, ``run.randn_like``) count their calls in
the micro-batch instead; the recomputation is handed the counts as they were when the module's
forward began (``context_fn``), so it draws the same too, in whatever order the backward
recomputes the blocks. The module keeps its class, attributes and state-dict keys: only its
``forward`` is wrapped.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddpkit.errors import ConfigError
from ddpkit.run.invariant.draws import SampleDraws


def checkpoint_modules(model: nn.Module, classes: tuple[str, ...], draws: SampleDraws | None) -> int:
    """Wrap the forward of every module of ``model`` whose class name is in ``classes``; returns
    how many. One line when none matches."""
    if not classes:
        return 0
    chosen = [m for m in model.modules() if type(m).__name__ in classes and m is not model]
    if not chosen:
        names = sorted({type(m).__name__ for m in model.modules()} - {type(model).__name__})
        raise ConfigError(
            f"checkpoint_modules={list(classes)} matches no module of {type(model).__name__}; "
            f"name some of its classes ({', '.join(names[:12])})"
        )
    for module in chosen:
        # An instance attribute shadows the class's forward: nn.Module.__call__ calls self.forward.
        module.forward = functools.partial(_recomputed, module.forward, draws)
    return len(chosen)


def _recomputed(forward: Callable, draws: SampleDraws | None, *args, **kwargs):
    if not torch.is_grad_enabled():  # nothing to free: evaluation runs as it is
        return forward(*args, **kwargs)
    contexts = functools.partial(_contexts, draws)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _contexts(draws: SampleDraws | None) -> tuple:
    """(around the forward, around its recomputation): the second gives the keyed draws the
    counts and keys the first began with."""
    if draws is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    began: dict = {}
    return _remember(draws, began), _replay(draws, began)


def _state(draws: SampleDraws) -> tuple:
    return dict(draws.calls), draws.keys, draws.step, draws.offset, draws.rows, draws.active


def _set(draws: SampleDraws, state: tuple) -> None:
    calls, draws.keys, draws.step, draws.offset, draws.rows, draws.active = state
    draws.calls = dict(calls)


@contextlib.contextmanager
def _remember(draws: SampleDraws, began: dict) -> Iterator[None]:
    began["state"] = _state(draws)
    yield


@contextlib.contextmanager
def _replay(draws: SampleDraws, began: dict) -> Iterator[None]:
    now = _state(draws)
    _set(draws, began["state"])
    # The forward's functional dropout was keyed in its model's mode; the backward is outside it.
    mode = next((forward for forward in draws.forwards if forward.keyed), contextlib.nullcontext())
    try:
        with mode:
            yield
    finally:
        _set(draws, now)
