"""``run.save_best(value)``: the weights of the best validation value so far, kept apart.

nanoGPT and most fine-tuning scripts keep the checkpoint with the best validation loss, which
their sampling or serving script reads. ``run.save_best`` writes each model's plain weights to
``OUT/best.pt`` (``OUT/best_NAME.pt`` for a model named otherwise), atomically, when the value
beats the best so far, and asks for a checkpoint at the end of the step, so the best value and
step are checkpointed with the run (under the reserved name ``ddpkit_best``): a resumed run
does not overwrite a better model with a worse one, and a rerun after a kill writes the same
bytes again. Every rank calls it (a sharded model's weights are gathered from every rank);
rank 0's value decides.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run.engine.models import save_weights
from ddpkit.run.state.registry import DictState

NAME = "ddpkit_best"  # the checkpoint part holding the best value and step (optional in old checkpoints)


class BestKeeper(DictState):
    """The best value so far, its step and mode; checkpointed as a part of the run."""

    def __init__(self) -> None:
        super().__init__({"value": None, "step": None, "mode": None})

    def offer(
        self,
        value: object,
        mode: str,
        step: int,
        models: dict[str, nn.Module],
        out: Path | None,
        env: DistEnv,
    ) -> bool:
        """Keep ``models``' weights if ``value`` is the best so far; True when it was. Collective."""
        if mode not in ("min", "max"):
            raise ConfigError(f"run.save_best(mode={mode!r}): use 'min' (a loss) or 'max' (an accuracy)")
        if out is None:
            raise ConfigError("run.save_best writes OUT/best.pt; give ddpkit.Run(out=FOLDER)")
        if self.values["mode"] not in (None, mode):
            raise ConfigError(
                f"run.save_best(mode={mode!r}): the run's best so far was kept with "
                f"mode={self.values['mode']!r}; keep one mode for a run"
            )
        number = _number(value)
        agreed = torch.tensor([number], dtype=torch.float64, device=env.collective_device)
        if env.world_size > 1:
            dist.broadcast(agreed, 0)  # rank 0's value decides, on every rank alike
        number = float(agreed.item())
        best = self.values["value"]
        if best is not None and not (number < best if mode == "min" else number > best):
            return False
        self.values.update(value=number, step=step, mode=mode)
        for name, model in models.items():
            save_weights(model, out / ("best.pt" if name == "model" else f"best_{name}.pt"), env)
        return True


def _number(value: object) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().item())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(
        f"run.save_best({value!r}): give the validation value, a number or a one-element tensor"
    )
