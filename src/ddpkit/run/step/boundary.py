"""What runs between two steps: the closed step's log line, replica check, checkpoint and the
preemption agreement, collectives every rank reaches at the same point.

``StepCycle`` (cycle.py) closes a step after its last micro-batch and hands it here when the next
step opens or the run finishes (``settle``), so an epoch's checkpoint holds what the loop did
after the epoch. ``Boundary`` is a plain object the cycle owns: it is given the parts it calls
(the monitor, the optimizer gate, the replica check, the preemption handler) when it is made, and
the step's position (number, epoch, whether it is the run's last, whether the loop is between
steps) at each call; what it keeps is its own: the checkpoint asked for, the last one written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from ddpkit.checkpoint.background import BackgroundWriter
from ddpkit.errors import ConfigError
from ddpkit.run.config import CheckpointConfig
from ddpkit.run.engine.buffers import sync_buffers
from ddpkit.run.monitor.monitor import Monitor
from ddpkit.run.state import checkpoints
from ddpkit.run.state.session import Session
from ddpkit.run.step.optim import OptimizerGate
from ddpkit.run.step.preempt import Preemption
from ddpkit.run.step.replicas import ReplicaCheck

log = logging.getLogger(__name__)


class Boundary:
    """The boundary after a step, and the run's checkpoints.

    Args:
        session: the checkpoint the run continues from (restored once, at the first batch).
        monitor: the metrics line and the hang watchdog's phases.
        gate: the non-finite check and what a line says of the optimizers (lr, skipped steps).
        objects: name -> what a checkpoint holds; models: name -> wrapped model.
        out: the run's folder (None: no files).
        ckpt_cfg: when to checkpoint, and the preemption signals.
        steps: the last step to run, or None.
    """

    def __init__(
        self,
        session: Session,
        monitor: Monitor,
        gate: OptimizerGate,
        objects: dict[str, Any],
        models: dict[str, nn.Module],
        out: Path | None,
        ckpt_cfg: CheckpointConfig,
        steps: int | None,
    ) -> None:
        self.session, self.env, self.monitor, self.gate = session, session.env, monitor, gate
        self.objects, self.models, self.out, self.ckpt_cfg, self.steps = objects, models, out, ckpt_cfg, steps
        self.saved_step = session.saved["step"] if session.saved is not None else 0
        self.save_now = False  # run.save() or save_best asked for a checkpoint of this step
        self.final = False  # the last checkpoint written is marked as the command's finished run
        self.saves: tuple[int, Any] = (0, None)  # checkpoints this process wrote, and the last
        self.writer = BackgroundWriter() if ckpt_cfg.async_save else None  # rank 0's, async_save
        if self.writer is not None:
            gate.before_update = self.writer.wait_staged
        self.buffers = False  # a saved model has buffers a forward may change (BatchNorm's statistics)
        self.preemption = Preemption(ckpt_cfg.preempt_signals, self.env.collective_device)
        self.replicas = ReplicaCheck(self.env, monitor.phase, models)

    def settle(
        self, step: int, epoch: int, ended: bool, last: bool, between: bool, reached: int | None
    ) -> int:
        """The boundary after step ``step`` (``ended``: it trained; ``last``: the run's last;
        ``between``: the loop is outside a step, so run.log lines of their own are due;
        ``reached``: the loader's epoch, which a finished run's checkpoint records). Returns
        the signal every rank agreed to stop on (0: none); the cycle then checkpoints and exits.

        After an epoch's last step the boundary comes at the next step's start (or the run's
        end), so what the loop did after the epoch (validation, a plateau scheduler, early
        stopping, run.log) is in that step's checkpoint, neither lost nor repeated on resume."""
        if not ended and not last:
            return 0
        if last or self.save_now or self._logs_or_saves(step):
            self.gate.check_norms()  # nothing non-finite reaches a log line or a checkpoint
        # The signal rides on the log gather, which is read at the next step's end: every rank
        # then reads the same maximum, so all stop at that step.
        logged, gathering = self.monitor.step_done(
            step, ended, last, self._extra(epoch), self.preemption.received
        )
        number = 0
        if logged is not None:
            record, number = logged
            self._pace(record)
        if last and between:
            self.flush_between(step, epoch)  # logged after the last epoch, before the last checkpoint
        if self.replicas.pending:
            self.replicas.finish()
        every = self.ckpt_cfg.save_every
        due = self.save_now or (every > 0 and (step % every == 0 or last))
        save = due and (self.saved_step != step or (last and not self.final))
        # A checkpoint of the last step (run.save() after the budget stopped the loop, with
        # save_every=0) is written again, marked finished: the same command then does nothing.
        save = save or (last and not self.final and self.saved_step == step > 0 and self.out is not None)
        check_every = self.monitor.check_every
        if check_every and ended and (step % check_every == 0 or last):
            self.replicas.start(step)
            if last or save:  # nothing follows to finish it; a checkpoint holds checked replicas only
                self.replicas.finish()
        if save:
            self.checkpoint(step, epoch, between, final=last, epoch_reached=reached)
        if not ended or last:
            return 0
        if not number and not gathering:  # else it rides on this step's gather
            number = self.preemption.agreed(step)
        return number

    def _logs_or_saves(self, step: int) -> bool:
        every = self.ckpt_cfg.save_every
        return step % self.monitor.every == 0 or step == 1 or (every > 0 and step % every == 0)

    def flush_between(self, step: int, epoch: int) -> None:
        """Write what run.log got between steps as a line of the last step's. Collective."""
        self.monitor.flush_between(step, {"epoch": epoch})

    def _pace(self, record: dict) -> None:
        # From the gathered median step, so every rank computes the same pace for the agreement.
        if record["step_s"] > 0:
            self.monitor.pace(record["step_s"])
            self.preemption.pace(record["step_s"], self.monitor.every)

    def _extra(self, epoch: int) -> dict:
        """A metrics line's own fields, made every step (one small dict): the step's epoch (not the
        pass the loader is on now), the skipped steps, and the rate the step ran at (a scheduler
        stepped after the optimizer has set the next one)."""
        gate = self.gate
        extra = {"epoch": epoch, "skipped_steps": gate.skipped_steps}
        if gate.last_lr is not None:
            extra["lr"] = gate.last_lr
        return extra

    def restore(self, step: int) -> None:
        """Every registered object gets its part of the checkpoint the run continues from (once)."""
        if (taken := self.session.take_saved()) is not None:
            checkpoints.restore_run(*taken, self.objects, self.models, self.env, step)

    def checkpoint(
        self, step: int, epoch: int, between: bool, final: bool = False, epoch_reached: int | None = None
    ) -> None:
        """Write every registered object's state at ``step`` (``final``: marked as the command's
        finished run, which the same command then leaves alone; ``epoch_reached``: the loader's
        epoch then). Collective."""
        if self.out is None:
            raise ConfigError("run.save() needs out=FOLDER to write the checkpoint into")
        self.restore(step)  # saved before the loop's first batch: what it resumed, not fresh objects
        self.gate.check_norms()
        self.save_now, self.saved_step, self.final = False, step, final
        # The step's log lines first: a run killed after this checkpoint resumes after them.
        self.monitor.flush()
        if between:
            self.flush_between(step, epoch)
        self.monitor.phase(step, "checkpoint: RNG states all_gather_object")
        for model in self.models.values():  # the buffers the next forward uses, whoever writes them
            sync_buffers(model)
        finished = {**checkpoints.command(self.steps), "epoch": epoch_reached} if final else None
        path = checkpoints.save(
            self.out / "checkpoints", step, self.objects, self.env, self.ckpt_cfg, finished, self.writer
        )
        if self.writer is not None:  # the background copy may still read them at the next forward
            self.buffers = any(b.is_floating_point() for m in self.models.values() for b in m.buffers())
        if path is not None:  # quiet: one line at the run's end says how many and the last
            log.debug("saved %s", path)
            self.saves = (self.saves[0] + 1, path)

    def before_forward(self) -> None:
        """Before a micro-batch: a model whose buffers a forward may change waits for a checkpoint's
        background copy to be done (async_save); the weights wait only for the optimizer step."""
        if self.writer is not None and self.buffers:
            self.writer.wait_staged()

    def landed(self) -> None:
        """Wait for a checkpoint written in the background (async_save) to land."""
        if self.writer is not None:
            self.writer.wait()

    def said_saves(self) -> None:
        """One line at the run's end: how many checkpoints, and the last."""
        if self.saves[0]:
            log.info("%d checkpoint(s) written, the last %s", *self.saves)
