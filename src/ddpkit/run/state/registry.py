"""The names a Run's checkpoint gives what the user registers (``run.setup``, ``run.track``)."""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.errors import ConfigError


def new_name(taken: dict[str, Any], name: str | None, kind: str) -> str:
    """``name``, or for None the kind numbered from the second on ("optimizer", "optimizer2", ...);
    a name already taken is refused in one line."""
    if name is None:
        same = sum(1 for n in taken if n == kind or n.startswith(kind) and n[len(kind) :].isdigit())
        name = kind if same == 0 else f"{kind}{same + 1}"
    if name in taken:
        raise ConfigError(f"the run already tracks an object named {name!r}; give this one another name")
    return name


def kind_of(obj: Any) -> str:
    """The default name of a tracked object: its kind, numbered from the second on."""
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
        return "scheduler"
    return "scaler" if isinstance(obj, torch.amp.GradScaler) else type(obj).__name__.lower()


class DictState:
    """A dict of the loop's own state (``{"best_val": 0.3, "bad_epochs": 1}``), checkpointed by
    ``run.track(loop=state)`` and restored in place: the user's dict is the one that changes."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values.clear()
        self.values.update(state)
