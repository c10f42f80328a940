"""Mixed precision for a wrapped model: its forward under autocast, its outputs handed back in
float32 so a loss computed outside is float32 as in the user's own fp32 loop."""

from __future__ import annotations

import functools

import torch


def autocast_forward(forward, device_type: str, dtype: torch.dtype):
    """Run ``forward`` under autocast and hand back float32 outputs, so a loss outside is fp32."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            output = forward(*args, **kwargs)
        return to_float32(output)

    return run


def to_float32(value):
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, dict):
        return type(value)({k: to_float32(v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_float32(v) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(to_float32(v) for v in value)
    return value
