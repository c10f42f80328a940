"""Draws a model's forward makes by calling a function: keyed per sample, or seen and named.

``nn.Dropout`` modules are keyed by swapping their class (dropout.py), but a forward can draw
without a module of its own: transformers' attention passes ``self.attn_dropout.p`` on to
``F.dropout`` (eager) or to ``scaled_dot_product_attention(dropout_p=...)`` (sdpa), so the
module it names is never called. ``ForwardDraws`` is a ``TorchFunctionMode`` that a forward
pre-hook enters around the model's forward (a forward hook with ``always_call`` leaves it, also
on an exception); unkeyed, only while the first micro-batch is observed. Under
``invariant_dropout`` it routes those two calls to a mask keyed by the
sample (``draws.SampleDraws.mask``): ``F.dropout`` multiplies by it; attention then runs torch's
math form (scores, softmax, the keyed mask, times V), which holds the (B, heads, L, S) weights in
memory where the fused kernels do not. The n-th such call of a micro-batch draws the n-th
stream, so activation checkpointing's recomputation (recompute.py, which replays the counts and
enters this mode) draws the same.

While the run's first micro-batch is in the loop (``observing``), the mode also records every
draw the forward makes from torch's global generator, by call and by the module it is made in
(the nearest caller whose ``self`` or ``module`` is one of the model's): the first step's report
(first_step.py) says which of them change with the world size. Under ``torch.compile`` the hook
does nothing: a compiled forward's functional draws stay the process's own.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ddpkit.run.invariant import keyed
from ddpkit.run.invariant.draws import SampleDraws

_DROPOUT, _ATTENTION = keyed.salt("functional", "dropout"), keyed.salt("functional", "attention")

# Calls that draw from torch's global generator unless handed a generator of their own.
_TORCH = ("rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like")
_TORCH += ("bernoulli", "normal", "multinomial", "poisson")
_TENSOR = ("bernoulli", "bernoulli_", "normal_", "uniform_", "random_", "exponential_", "geometric_")
_TENSOR += ("cauchy_", "log_normal_")
_FUNCTIONAL = ("dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "rrelu")
GLOBAL_DRAWS = (
    {getattr(torch, name) for name in _TORCH}
    | {getattr(torch.Tensor, name) for name in _TENSOR}
    | {getattr(F, name) for name in _FUNCTIONAL}
)


class ForwardDraws(TorchFunctionMode):
    """The functional draws of one model's forward.

    Args:
        model: the user's model (hooks go on it; its modules name what is seen).
        draws: the run's per-sample keys.
        batch_dim: the batch dimension of ``F.dropout``'s inputs (``dropout_batch_dim``).
        keyed: key ``F.dropout`` and attention's ``dropout_p`` per sample (``invariant_dropout``).
    """

    def __init__(self, model: nn.Module, draws: SampleDraws, batch_dim: int, keyed: bool) -> None:
        super().__init__()
        # Inside a model compiled before run.setup, where the hooks are traced and do nothing: a
        # mode around a compiled call, or hooks that come and go, would make it compile again.
        model = getattr(model, "_orig_mod", model)
        self.draws, self.batch_dim, self.keyed = draws, batch_dim, keyed
        self.model_name = type(model).__name__
        self.observing, self.compiled = False, False
        self.seen: list[tuple[str, str, bool]] = []  # (call, module, keyed) while observing
        self._names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
        self._depth = 0
        self._hooks = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def __deepcopy__(self, memo: dict) -> ForwardDraws:
        return self  # an EMA's deepcopy of the model keeps its hooks on the run's draws

    def remove(self) -> None:
        """Take the hooks off the model."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def done_observing(self) -> None:
        """The first micro-batch is over. Unkeyed, the hooks come off an eager model (a module
        with hooks takes torch's slower call path, priced in docs/engine.md); on a
        compiled one they stay, entering nothing, for its guards see the same hooks every call."""
        self.observing = False
        if not self.keyed and not self.compiled:
            self.remove()

    def _enter(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            self.compiled = True
            return
        if not (self.keyed or self.observing):
            return
        if not (module.training and self.draws.active):
            return
        self._depth += 1
        if self._depth == 1:
            self.__enter__()

    def _leave(self, module: nn.Module, args: tuple, output: object) -> None:
        if torch.compiler.is_compiling() or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            p, training = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True)
            if training and p > 0:
                return self._dropout(args, kwargs, p)
        elif func is F.scaled_dot_product_attention:
            p = _arg(args, kwargs, 4, "dropout_p", 0.0)
            if p > 0:
                return self._attention(args, kwargs, p)
        elif self.observing and func in GLOBAL_DRAWS and kwargs.get("generator") is None:
            self._see(getattr(func, "__name__", str(func)), False)
        return func(*args, **kwargs)

    def _dropout(self, args: tuple, kwargs: dict, p: float) -> torch.Tensor:
        self._see(f"F.dropout(p={p:g})", self.keyed)
        if not (self.keyed and self.draws.active):
            return F.dropout(*args, **kwargs)
        x, dim = args[0] if args else kwargs["input"], self.batch_dim
        moved = x.movedim(dim, 0) if dim else x
        mask = self.draws.mask(_DROPOUT, x, p, moved[0].numel(), dim).reshape(moved.shape)
        mask = mask.movedim(0, dim) if dim else mask
        return x.mul_(mask) if _arg(args, kwargs, 3, "inplace", False) else x * mask

    def _attention(self, args: tuple, kwargs: dict, p: float) -> torch.Tensor:
        self._see(f"scaled_dot_product_attention(dropout_p={p:g})", self.keyed)
        if not (self.keyed and self.draws.active):
            return F.scaled_dot_product_attention(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = dict(zip(names, args, strict=False)) | kwargs
        return keyed_attention(self.draws, **given)

    def _see(self, call: str, was_keyed: bool) -> None:
        if self.observing:
            self.seen.append((call, self._module_name(), was_keyed))

    def _module_name(self) -> str:
        """The model's module the call is made in: the nearest caller whose ``self`` or ``module``
        (transformers' attention functions take the module as ``module``) is one of the model's."""
        frame = sys._getframe(2)
        while frame is not None:
            for local in ("self", "module"):
                name = self._names.get(id(frame.f_locals.get(local)))
                if name is not None:
                    return name
            frame = frame.f_back
        return "?"


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: object) -> object:
    return args[index] if len(args) > index else kwargs.get(name, default)


def keyed_attention(
    draws: SampleDraws,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` in torch's math form, its attention weights dropped out by
    a mask keyed per sample (dim 0 of ``query`` holds the micro-batch's samples)."""
    length, source = query.size(-2), key.size(-2)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:  # (B, heads_kv, S, E) repeated to the query's heads
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    weights = (query * scale) @ key.transpose(-2, -1)  # (B, heads, L, S)
    masked = is_causal or attn_mask is not None
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        weights = weights.masked_fill(~causal, float("-inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        weights = weights.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        weights = weights + attn_mask
    weights = torch.softmax(weights, dim=-1)
    if masked:  # a row masked whole is all zeros, as torch's math kernel makes it (not NaN)
        weights = weights.nan_to_num(0.0)
    mask = draws.mask(_ATTENTION, weights, dropout_p, weights[0].numel(), 0).reshape(weights.shape)
    return (weights * mask) @ value
