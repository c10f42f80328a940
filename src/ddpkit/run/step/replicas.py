"""Replica checks between steps: every few steps all ranks compare parameter fingerprints."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.diagnostics.fingerprint import check_rows, fingerprint
from ddpkit.dist import DistEnv
from ddpkit.run.engine.wrap import unwrap


class ReplicaCheck:
    """Every ``check_every`` steps, all ranks compare parameter fingerprints with rank 0's.

    The fingerprints' all_gather runs in the background and is read at the next step's end (at
    once on the run's last step), so a check step waits for no rank; a replica that drifted
    then stops every rank one step later, naming the step it was seen at.
    """

    def __init__(self, env: DistEnv, phase: Callable[[int, str], None], models: dict[str, nn.Module]) -> None:
        self.env, self.phase, self.models = env, phase, models
        self.pending: list[tuple] = []
        self.step = 0

    def start(self, step: int) -> None:
        self.phase(step, "check: replica fingerprint all_gather")
        self.step = step
        for name, model in self.models.items():
            names, local = fingerprint(unwrap(model), buffers=False)  # between steps: no buffers
            local = local.to(self.env.collective_device)
            rows = [torch.empty_like(local) for _ in range(self.env.world_size)]
            self.pending.append((name, names, rows, dist.all_gather(rows, local, async_op=True)))

    def finish(self) -> None:
        """Wait for the gathers; raises on every rank if any replica differs from rank 0's."""
        self.phase(self.step, "check: replica fingerprint all_gather")
        pending, self.pending = self.pending, []
        for name, names, rows, work in pending:
            work.wait()
            check_rows(rows, names, f"at step {self.step} ({name})")
