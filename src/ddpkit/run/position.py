"""Where a ``ddpkit.Run`` is: which process this is, and the step and micro-batch in hand.

The part of ``Run``'s public face that only reads (api.md's "Who and where this process is" and
the step's position); ``Run`` inherits it. Every value comes from the run's ``DistEnv`` or its
step cycle, the one owner of the step's state.
"""

from __future__ import annotations

from typing import Any

from ddpkit.dist import DistEnv
from ddpkit.run.config import DataConfig, RunConfig
from ddpkit.run.step.cycle import StepCycle


class RunPosition:
    """Read-only properties of a run's process and step (``Run`` sets ``env`` and ``_cycle``)."""

    env: DistEnv
    _cycle: StepCycle
    _cfg: RunConfig
    _data_cfg: DataConfig

    @property
    def rank(self) -> int:
        """This process's global rank, 0 to ``world_size - 1``."""
        return self.env.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (its GPU's index when there are GPUs)."""
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        """The number of processes in the run."""
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the one that writes files and logs. Calls that every rank must
        make (``save``, ``evaluate``, ``finish``) do not belong under ``if run.is_main``."""
        return self.env.is_rank0

    @property
    def steps(self) -> int | None:
        """The run's step budget (``steps=``), None when the loop's epochs decide."""
        return self._cfg.steps

    @property
    def micro_batch(self) -> int | None:
        """Samples per micro-batch on each rank (``micro_batch=``), None: each rank's whole share
        of a step in one."""
        return self._data_cfg.micro_batch

    @property
    def step(self) -> int:
        """Optimizer steps begun (inside the loop, the running one counts); a resume starts at its own."""
        return self._cycle.step

    @property
    def batch_offset(self) -> int:
        """The place of this micro-batch's first sample in the step's global batch: its row in
        ``run.all_gather``'s result (an InfoNCE's labels are ``run.batch_offset + arange(len(x))``)."""
        micro = self._cycle.micro
        return micro.offset if micro is not None else 0

    @property
    def at_step_end(self) -> bool:
        """True after a step's last micro-batch came out of the loader: the step is complete once
        the optimizer steps, and a collective here (``run.evaluate``) is reached by every rank."""
        return self._cycle.at_step_end

    @property
    def loss(self) -> float | None:
        """The loss of the last metrics line: the mean over every rank and micro-batch of its
        steps (what ``metrics.jsonl`` says, the same on any world size). Its gather finishes
        without a wait, so in the loop it is the line of two steps before (None until then);
        after ``finish``, the last line's. ``loss.item()`` is this rank's micro-batch alone."""
        return self._cycle.monitor.last_loss

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only, flushed unless ``flush=False`` says otherwise."""
        if self.env.is_rank0:
            print(*args, **{"flush": True, **kwargs})
