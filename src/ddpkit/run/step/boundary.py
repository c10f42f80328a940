"""The step cycle's boundaries: closing a step, and what follows it before the next one opens.

``StepCycle`` (run/step/cycle.py) drives the loop, micro-batch by micro-batch; these methods are the
rest of it, on the same object: a step closes after its last micro-batch (its position, its
timing), and its boundary (the log line, the replica check, the checkpoint, the preemption
agreement: collectives every rank reaches at the same point) runs when the next step opens or
the run finishes. Split from cycle.py by what they do; they share the cycle's state.
"""

from __future__ import annotations

import logging

from ddpkit.errors import ConfigError
from ddpkit.run.state import checkpoints, resume
from ddpkit.run.step.preempt import exit_preempted

log = logging.getLogger(__name__)


class StepBoundaries:
    """Mixed into ``StepCycle``: the methods that close a step and run its boundary."""

    # --- step boundaries -----------------------------------------------------------------------

    def end_step(self) -> None:
        """The open step's last micro-batch is done: its position moves on, its boundary waits."""
        self.gate.check_stepped(self.step, self.cut)
        self.held.restore()  # a loop left mid-step: the gradients are the user's again
        self.draws.leave()
        self.gate.scaler.update()
        self.source.advance_to(self.micro.consumed)
        self.monitor.samples_taken(self.step, self.indices)
        self.monitor.step_ended()
        self.micro, self.unsettled = None, True
        self.state.open = self.state.accumulating = self.state.has_backward = False

    def settle(self, last: bool = False) -> None:
        """The boundary after the last step (its log line, fingerprint check, checkpoint, the
        preemption agreement), closing it first if it is open.

        After an epoch's last step the boundary comes at the next step's start (or the run's
        end), so what the loop did after the epoch (validation, a plateau scheduler, early
        stopping, run.log) is in that step's checkpoint, neither lost nor repeated on resume."""
        if self.open:
            self.end_step()
        ended, self.unsettled = self.unsettled, False
        last = last or (self.steps is not None and self.step >= self.steps)
        if not ended and not last:
            return
        if last or self.save_now or self._logs_or_saves():
            self.gate.check_norms()  # nothing non-finite reaches a log line or a checkpoint
        # The signal rides on the log gather, which is read at the next step's end: every rank
        # then reads the same maximum, so all stop at that step.
        logged, gathering = self.monitor.step_done(
            self.step, ended, last, self._extra(), self.preemption.received
        )
        number = 0
        if logged is not None:
            record, number = logged
            self._pace(record)
        if last and self.outside:
            self.flush_between()  # what was logged after the last epoch, before the last checkpoint
        if self.replicas.pending:
            self.replicas.finish()
        every = self.ckpt_cfg.save_every
        due = self.save_now or (every > 0 and (self.step % every == 0 or last))
        save = due and (self.saved_step != self.step or (last and not self.final))
        # A checkpoint of the last step (run.save() after the budget stopped the loop, with
        # save_every=0) is written again, marked finished: the same command then does nothing.
        save = save or (last and not self.final and self.saved_step == self.step > 0 and self.out is not None)
        check_every = self.monitor.check_every
        if check_every and ended and (self.step % check_every == 0 or last):
            self.replicas.start(self.step)
            if last or save:  # nothing follows to finish it; a checkpoint holds checked replicas only
                self.replicas.finish()
        if save:
            self.checkpoint(final=last)
        if not ended or last:
            return
        if not number and not gathering:  # else it rides on this step's gather
            number = self.preemption.agreed(self.step)
        if number:
            self._preempted(number)

    def _logs_or_saves(self) -> bool:
        every = self.ckpt_cfg.save_every
        return self.step % self.monitor.every == 0 or self.step == 1 or (every > 0 and self.step % every == 0)

    def flush_between(self) -> None:
        """Write what run.log got between steps as a line of the last step's. Collective."""
        self.monitor.flush_between(self.step, {"epoch": self.epoch})

    def _pace(self, record: dict) -> None:
        # From the gathered median step, so every rank computes the same pace for the agreement.
        if record["step_s"] > 0:
            self.monitor.pace(record["step_s"])
            self.preemption.pace(record["step_s"], self.monitor.every)

    def _extra(self) -> dict:
        """A metrics line's own fields, made every step (one small dict): the step's epoch (not the
        pass the loader is on now), the skipped steps, and the rate the step ran at (a scheduler
        stepped after the optimizer has set the next one)."""
        gate = self.gate
        extra = {"epoch": self.state.epoch, "skipped_steps": gate.skipped_steps}
        if gate.last_lr is not None:
            extra["lr"] = gate.last_lr
        return extra

    def checkpoint(self, final: bool = False) -> None:
        """Write every registered object's state at this step (``final``: marked as the command's
        finished run, which the same command then leaves alone). Collective."""
        if self.out is None:
            raise ConfigError("run.save() needs out=FOLDER to write the checkpoint into")
        self.restore()  # saved before the loop's first batch: what it resumed, not fresh objects
        self.gate.check_norms()
        self.save_now, self.saved_step, self.final = False, self.step, final
        # The step's log lines first: a run killed after this checkpoint resumes after them.
        self.monitor.flush()
        if self.outside:
            self.flush_between()
        self.monitor.phase(self.step, "checkpoint: RNG states all_gather_object")
        finished = {**checkpoints.command(self.steps), "epoch": self._epoch_reached()} if final else None
        path = checkpoints.save(
            self.out / "checkpoints", self.step, self.objects, self.env, self.ckpt_cfg, finished, self.writer
        )
        if path is not None:  # quiet: one line at the run's end says how many and the last
            log.debug("saved %s", path)
            self.saves = (self.saves[0] + 1, path)

    def _epoch_reached(self) -> int | None:
        """The loader's epoch at the run's end (``loader.epoch``): a loop over more trains on."""
        return self.source.epoch if self.source is not None else None

    # --- the end -------------------------------------------------------------------------------

    def finish(self) -> None:
        """``run.finish``: close the last step as the run's last (its log line and checkpoint)."""
        if not self.started and (finished := self.session.finished_run()) is not None:
            return self._leave_finished(finished)
        if self.started:
            self.settle(last=True)
        if self.writer is not None:
            self.writer.wait()  # the last checkpoint has landed before the run says it finished
        self.restore()  # a resumed run that had nothing left to do still checks what it resumed
        if self.saves[0]:
            log.info("%d checkpoint(s) written, the last %s", *self.saves)

    def _leave_finished(self, saved: dict) -> None:
        """A finished run resumed by another command whose loop ran no step (no more epochs than it
        ran): every registered object gets the checkpoint's state, rank 0 says so in one line,
        and the run closes as finished with no collective and no checkpoint (Run writes no
        OUT/NAME.pt either), so a rank whose code after the loop failed leaves the others nothing
        to wait for."""
        taken = self.session.take_saved()
        assert taken is not None, "a finished run's checkpoint is restored once"
        checkpoints.restore_run(*taken, self.objects, self.models, self.env, self.step, check=False)
        if self.env.is_rank0:
            print(resume.trained_nothing(self.out or taken[0], saved, self.steps), flush=True)
        self.close(plot=True)  # its trackers' runs end as finished; loss.png is drawn again, alike

    def close(self, plot: bool = False) -> None:
        """Stop the diagnostics and leave the process group without another collective."""
        if self.closed:
            return
        self.closed = True
        self.preemption.restore()
        self.monitor.close(plot)
        self.session.leave()

    def _preempted(self, number: int) -> None:
        """Every rank, once all agree a signal came: checkpoint this step, leave, and exit."""
        if self.out is not None and self.saved_step != self.step:
            if self.replicas.pending:
                self.replicas.finish()
            self.checkpoint()
        if self.writer is not None:
            self.writer.wait()  # the checkpoint has landed before the process exits
        self.monitor.flush()  # written already when the step was checkpointed just now
        self.close()
        exit_preempted(number, self.step, self.out is not None, self.env.is_rank0)
