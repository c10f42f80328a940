"""Dropout modules in the user's model, drawn per sample when asked.

``nn.Dropout`` draws its mask from the generator of the process that runs it, in the order its
micro-batches come, so the same sample gets another mask on another world size or micro_batch
(1 and 2 processes 4.6e-2 apart with p=0.2). Without ``invariant_dropout`` rank 0 says so in
one line after the first micro-batch (first_step.py). With it, each dropout-like module's class
is swapped for a subclass (as ``run.track`` swaps an optimizer's) whose training forward inside
a step multiplies by a mask keyed by the sample (``draws.SampleDraws.mask``); in eval mode, or
outside a step, it is the module's own forward.

What is recognised: ``nn.Dropout`` (per element), ``nn.Dropout1d/2d/3d`` (per channel), and
stochastic depth, timm's ``DropPath`` or any module with ``drop_prob`` (per sample). Alpha
dropout is refused in one line. A functional ``F.dropout`` in a forward, or
``scaled_dot_product_attention(dropout_p=...)`` (transformers' attention), is keyed by
functional_dropout.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.run.invariant import keyed
from ddpkit.run.invariant.draws import SampleDraws

CHANNELS = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
ALPHA = (nn.AlphaDropout, nn.FeatureAlphaDropout)


def rate(module: nn.Module) -> float:
    """The module's drop probability when it is dropout-like (0 otherwise)."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return float(module.p)
    value = getattr(module, "drop_prob", None)  # timm's DropPath, DeBERTa's StableDropout
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def dropout_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The dropout-like modules of ``model`` with a probability above 0, by qualified name."""
    return [(name, m) for name, m in model.named_modules() if rate(m) > 0]


def key_dropout(model: nn.Module, draws: SampleDraws, batch_dim: int) -> int:
    """Swap every dropout-like module of ``model`` for its per-sample keyed subclass; how many."""
    found = dropout_modules(model)
    for name, module in found:
        if isinstance(module, ALPHA):
            raise ConfigError(
                f"invariant_dropout: {name} is {type(module).__name__}, which it cannot key per sample; "
                "use nn.Dropout, or leave invariant_dropout off for this model"
            )
        cls = type(module)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(cls.__name__, (_KeyedDropout, cls), {"__module__": cls.__module__})
        module.__class__ = _CLASSES[cls]
        module._ddpkit_draws, module._ddpkit_salt = draws, keyed.salt("dropout", name)
        module._ddpkit_batch_dim = batch_dim
    return len(found)


_CLASSES: dict[type, type] = {}


class _KeyedDropout:
    """Mixed in before a dropout-like module's class by ``key_dropout``."""

    _ddpkit_draws: SampleDraws
    _ddpkit_salt: int
    _ddpkit_batch_dim: int

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        p = rate(self)
        if not (self.training and p > 0 and self._ddpkit_draws.active):
            return super().forward(x, *args, **kwargs)
        if isinstance(self, CHANNELS):  # (B, C, ...): one draw per sample and channel
            return x * self._ddpkit_draws.mask(self._ddpkit_salt, x, p, x.shape[1], 0).reshape(
                *x.shape[:2], *[1] * (x.dim() - 2)
            )
        if not isinstance(self, nn.Dropout):  # stochastic depth: one draw per sample
            keep = self._ddpkit_draws.mask(self._ddpkit_salt, x, p, 1, 0)
            if not getattr(self, "scale_by_keep", True):
                keep = keep * (1.0 - p)
            return x * keep.reshape(x.shape[0], *[1] * (x.dim() - 1))
        dim = self._ddpkit_batch_dim
        moved = x.movedim(dim, 0) if dim else x
        mask = self._ddpkit_draws.mask(self._ddpkit_salt, x, p, moved[0].numel(), dim)
        out = moved * mask.reshape(moved.shape)
        return out.movedim(0, dim) if dim else out
