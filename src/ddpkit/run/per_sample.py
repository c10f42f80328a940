"""What ``ddpkit.Run`` draws and gathers per sample in the loop: ``run.rand_like``, ``run.randn_like``,
``run.randint`` (keyed draws, draws.py) and ``run.all_gather`` (gather.py), as a base of Run."""

from __future__ import annotations

import torch

from ddpkit.run.invariant.gather import all_gather


class PerSample:
    """Run's per-sample calls; Run provides ``_draws`` (a SampleDraws), ``_cycle`` and ``env``."""

    def rand_like(self, x: torch.Tensor) -> torch.Tensor:
        """``torch.rand_like(x)`` drawn per sample: row i (dim 0) from (seed, step, sample i's place
        in the global batch), the same on any world size, micro_batch and after a resume."""
        return self._draws.rand_like(x)

    def randn_like(self, x: torch.Tensor) -> torch.Tensor:
        """``torch.randn_like(x)`` drawn per sample, as ``rand_like`` (a diffusion step's noise)."""
        return self._draws.randn_like(x)

    def randint(self, low: int, high: int | None = None, *, like: torch.Tensor) -> torch.Tensor:
        """One integer in [low, high) (or [0, low)) per sample of ``like`` (dim 0), drawn per sample
        as ``rand_like``: a diffusion step's timesteps, ``run.randint(T, like=x)``."""
        low, high = (0, low) if high is None else (low, high)
        return self._draws.randint(low, high, like)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (dim 0: its samples) in global-batch order, differentiable: an
        in-batch-negatives loss (InfoNCE, CLIP) over the gathered batch is one process's. Exact
        when each rank's share is one micro-batch; refused in one line under a smaller micro_batch."""
        self._cycle.first_step.note_gather()
        return all_gather(x, self._cycle.micro, self.env)
