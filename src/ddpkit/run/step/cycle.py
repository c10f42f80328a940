"""The step cycle: the one owner of where a Run is, and of when each step's boundary runs.

Every source of micro-batches (``map_source.MapSource``, ``stream.StreamSource``) is driven by
``StepCycle.drive``; the user's calls (``run.backward``, ``run.save``, the gated optimizers)
reach the same object. A step closes after its last micro-batch (its position, timing); its
boundary (log line, replica check, checkpoint, preemption agreement: collectives at the same
point on every rank; boundary.py) runs when the next step opens or the run finishes, so an
epoch's checkpoint holds what the loop did after the epoch: the boundary of step N therefore runs
inside step N+1's first fetch from the loader (``begin``), or at ``run.finish``. Between
micro-batches the cycle tells the engines whether the next backward synchronizes (only a step's
last does).

States of one process's run (``step`` counts optimizer steps begun)::

    registered --first batch (start): restore the checkpoint, open the bar--> started
    started --a step's first micro-batch (begin): settle the last step, open the next--> in a step
    in a step --its last micro-batch done, or the pass ends (end_step)--> unsettled
    unsettled --settle: its boundary (log line, check, checkpoint, preemption)--> started
    any --finish(): settle the last step as the run's last; close(): no collective--> closed

The step's state (its number, epoch, whether it is open or accumulating) lives in one
``StepState`` (run/step_state.py) that only this class writes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.run.config import CheckpointConfig
from ddpkit.run.engine.forward_order import agree_before_backward
from ddpkit.run.engine.wrap import set_grad_sync, unwrap
from ddpkit.run.invariant.bitwise import GrainSum
from ddpkit.run.invariant.draws import SampleDraws
from ddpkit.run.micro import Micro, to_device, tokens_in
from ddpkit.run.monitor import notices
from ddpkit.run.monitor.monitor import Monitor
from ddpkit.run.state import checkpoints, resume
from ddpkit.run.state.session import Session
from ddpkit.run.step.boundary import Boundary
from ddpkit.run.step.first_step import FirstStep
from ddpkit.run.step.losses import StepLosses, check_differentiable
from ddpkit.run.step.optim import OptimizerGate
from ddpkit.run.step.preempt import exit_preempted


class StepCycle:
    """One rank's position in the run (step, epoch, micro-batch, in or between steps) and what
    happens at its boundaries.

    Args:
        session: the process group, OUT's lock and the checkpoint to restore.
        monitor: timings, metrics lines, progress bar and the hang watchdog's phases.
        gate: what the gated optimizers read (built on this cycle's ``state`` and ``held``).
        objects: name -> what a checkpoint holds; models: name -> wrapped model (filled by Run).
        out: the run's folder (None: no files).
        ckpt_cfg: when to checkpoint, and the preemption signals.
        steps: the last step to run, or None.
        draws: the per-sample keys of the loop's and the model's draws.
        grains: a bitwise run's tree of grain gradients (None: the engines sum them).
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
        draws: SampleDraws,
        grains: GrainSum | None = None,
    ) -> None:
        self.session, self.env, self.monitor, self.gate = session, session.env, monitor, gate
        self.models, self.out, self.steps, self.draws, self.grains = models, out, steps, draws, grains
        self.boundary = Boundary(session, monitor, gate, objects, models, out, ckpt_cfg, steps)
        # The step state: written here alone, read by the gate, the engines and the EMAs, which
        # were handed the same object.
        self.state, self.held = gate.state, gate.held
        self.state.step = self.boundary.saved_step
        self.source: Any = None  # the source of the step begun last
        self.micro: Micro | None = None
        self.started = self.closed = False
        self.unsettled = False  # a closed step whose boundary (log, check, checkpoint) has not run
        # Between steps (before the loop's first and after each epoch's last) every rank is at the
        # same point, so run.log values from there are gathered for a line of their own.
        self.outside = True
        self.losses = StepLosses(self.env)
        self.cut: Micro | None = None  # the micro-batch the loop left its loader at, mid-step
        self.resumed_at, self.warned_budget, self.warned_stale = self.step, False, False
        self.indices: list[int] = []
        self.first_step = FirstStep(self.env, models, draws)  # what the first micro-batch did

    @property
    def step(self) -> int:
        """Optimizer steps begun (the step state's)."""
        return self.state.step

    @property
    def epoch(self) -> int:
        """The epoch of the last step begun."""
        return self.state.epoch

    @property
    def open(self) -> bool:
        """Inside a step."""
        return self.state.open

    @property
    def at_step_end(self) -> bool:
        """After a step's last micro-batch came out of the loader."""
        return self.micro is not None and self.micro.last

    # --- the loop ----------------------------------------------------------------------------

    def drive(self, source: Any) -> Iterator[Any]:
        """One pass of ``source`` (the rest of it after a resume): its batches on the device, each
        step opened before its first micro-batch is fetched and closed when the next one opens."""
        self.start()
        micros = source.start_pass()
        self.monitor.epoch_started(source.epoch, source.steps_done, source.steps_per_epoch, self.steps)
        move = self.env.device.type != "cpu"  # the DataLoader's batches are on the CPU already
        agreement = source.agreement  # the collective a source makes before each step (a stream's)
        step_next = True  # the next item opens a step
        while True:
            if agreement is not None and step_next:  # the hang watchdog names it if it waits
                self.monitor.phase(self.step, agreement)
            began = time.perf_counter()
            item = next(micros, None)  # a stream reads its step and agrees on it here: data too
            waited = time.perf_counter() - began
            if item is None:
                break
            micro, fetch = item
            step_next = micro.last
            if micro.first and not self.begin(source):
                return  # the run's step limit is reached
            began = time.perf_counter()
            batch = fetch()
            self.monitor.data(waited + time.perf_counter() - began)
            self.enter(micro, tokens_in(batch, micro.samples))
            self.first_step.before()
            try:
                yield to_device(batch, self.env.device) if move else batch
            except GeneratorExit:  # the loop left (a break): say so if it cut a step or an epoch
                self.left(micro, source)
                raise
            self.first_step.after(micro, source.global_batch)
        if self.open:  # its boundary (log, check, checkpoint) waits for the epoch-end code
            self.end_step()
        self.outside = True
        source.end_pass()

    def start(self) -> None:
        """The loop's first batch: a resumed run restores everything registered now."""
        if self.started:
            return
        self.boundary.restore(self.step)
        self.started = True
        self.monitor.start(self.step, self.steps)

    def begin(self, source: Any) -> bool:
        """Close the previous step and open the next; False once the run's last step is done."""
        self.settle()
        if self.steps is not None and self.step >= self.steps:
            self.outside = True
            return False
        if self.outside:
            self.boundary.flush_between(self.step, self.epoch)
            self.outside = False
        state, self.source, self.indices = self.state, source, []
        state.step, state.epoch, state.open, state.micro_batches = state.step + 1, source.epoch, True, 0
        state.has_backward = False
        self.losses.reset()
        self.monitor.phase(self.step, "forward/backward: gradient all-reduce")
        return True

    def enter(self, micro: Micro, tokens: int = 0) -> None:
        """The loop is about to get ``micro``'s batch (of ``tokens`` tokens that count)."""
        self.micro = micro
        self.boundary.before_forward()
        self.state.micro_batches += 1
        self.state.accumulating = not micro.last
        self.draws.enter(self.step, micro)
        self.monitor.micro_batch(micro.samples, tokens)
        if micro.samples and self.monitor.cfg.log_samples:
            self.indices += micro.indices
        if micro.first or micro.last:  # no_sync on all but the step's last micro-batch
            set_grad_sync(self.models.values(), micro.last and self.grains is None)

    def backward(self, loss: torch.Tensor, reduction: str, count: Any) -> None:
        """``run.backward``: the micro-batch's loss scaled to its share of the step (losses.py)."""
        check_differentiable(loss, self.models)
        agree_before_backward(list(self.models.values()))  # fsdp over gloo: every rank's forwards done
        micro = self.micro
        if micro is None:  # outside a run.loader loop: a plain backward
            self.state.has_backward = True
            self._backward(loss / count if count is not None else loss)
            return
        self.first_step.check_loss(loss, reduction, count)
        scale = self.losses.add(loss, reduction, count, micro, self.monitor)
        if self.gate.waited and not micro.last:
            self._warn_stale()
        self.state.has_backward = True
        if self.grains is not None:
            return self._grain_backward(loss * (scale / self.env.world_size), micro, count)
        self.held.restore(micro.last)  # the step's earlier micro-batches' gradients, to add to
        self._backward(loss * scale if scale != 1.0 else loss)
        if not micro.last:
            # Until the step's last backward, p.grad is None: a clip_grad_norm_ or any other edit
            # the user's loop makes before optimizer.step() then acts on the whole step's
            # all-reduced gradient, as without micro_batch, never on a partial local one.
            self.held.hold()
        elif count is not None:  # now that the gradient is the step's sum: over the global count
            self.losses.divide(self.models.values())

    def _grain_backward(self, loss: torch.Tensor, micro: Micro, count: Any) -> None:
        """``bitwise=True``: the grain's gradient alone (its loss weighed by its share of the
        global batch, on any world size), added into the step's tree; after the step's last, the
        ranks' sums added (run/invariant/bitwise.py). Nothing is held between grains but the
        placeholders, as between micro-batches."""
        self.held.restore(micro.last)
        self._backward(loss)
        params = [p for m in self.models.values() for p in unwrap(m).parameters() if p.requires_grad]
        self.grains.add(params, micro)
        if not micro.last:
            self.held.hold()
            return
        self.grains.finish(params)
        if count is not None:
            self.losses.divide(self.models.values())

    def _backward(self, loss: torch.Tensor) -> None:
        """The backward pass (fp16: of the scaled loss), its local part timed for the comm-wait split."""
        clock = self.monitor.clock
        began = clock.backward_begins()
        self.gate.scaler.scale(loss).backward()
        clock.backward_ended(began)

    def _warn_stale(self) -> None:
        if self.env.is_rank0 and not self.warned_stale:
            self.warned_stale = True
            notices.stale_weights(self.step)

    def log(self, metrics: dict[str, float | torch.Tensor], reduce: str) -> None:
        """``run.log``: for the step's metrics line, or between steps for a line of their own."""
        micro = self.micro if self.open else None
        weight = float(micro.samples) if micro is not None else 1.0
        for name, value in metrics.items():
            self.monitor.add_user(name, value, weight, reduce, self.step if micro is not None else -1)

    def left(self, micro: Micro, source: Any) -> None:
        """The loop left its loader at ``micro`` (a ``break``): remember a cut step; on a resumed run
        that leaves before the epoch's end, say once that a loop's own counter restarted at 0."""
        if not micro.last:
            self.cut = micro
            return
        per_epoch = source.steps_per_epoch
        inside = per_epoch is not None and -(-micro.consumed // source.global_batch) < per_epoch
        if self.resumed_at and inside and self.env.is_rank0 and not self.warned_budget:
            self.warned_budget = True
            notices.own_counter(self.step, self.resumed_at)

    def request_save(self) -> None:
        """``run.save``: checkpoint at the end of the current step (now, between steps)."""
        boundary = self.boundary
        boundary.save_now = True
        if not self.open:
            if self.unsettled:
                self.settle()  # the last step's boundary first: it writes this checkpoint
            if boundary.save_now:
                boundary.checkpoint(self.step, self.epoch, self.outside)

    # --- step boundaries -----------------------------------------------------------------------

    def end_step(self) -> None:
        """The open step's last micro-batch is done: its position moves on, its boundary waits."""
        self.gate.check_stepped(self.step, self.cut)
        self.held.restore()  # a loop left mid-step: the gradients are the user's again
        if self.grains is not None:
            self.grains.clear()  # a bitwise step cut short: its grains' sum is dropped
        self.draws.leave()
        self.gate.scaler.update()
        self.source.advance_to(self.micro.consumed)
        self.monitor.samples_taken(self.step, self.indices)
        self.monitor.step_ended()
        self.micro, self.unsettled = None, True
        self.state.open = self.state.accumulating = self.state.has_backward = False

    def settle(self, last: bool = False) -> None:
        """The boundary after the last step (boundary.py), closing it first if it is open; a stop
        every rank agreed on there checkpoints this step and exits."""
        if self.open:
            self.end_step()
        ended, self.unsettled = self.unsettled, False
        last = last or (self.steps is not None and self.step >= self.steps)
        if number := self.boundary.settle(self.step, self.epoch, ended, last, self.outside, self._reached()):
            self._preempted(number)

    def _reached(self) -> int | None:
        """The loader's epoch (``loader.epoch``), which a finished run's checkpoint records: a
        loop over more epochs trains on."""
        return self.source.epoch if self.source is not None else None

    # --- the end -------------------------------------------------------------------------------

    def finish(self) -> None:
        """``run.finish``: close the last step as the run's last (its log line and checkpoint)."""
        if not self.started and (finished := self.session.finished_run()) is not None:
            return self._leave_finished(finished)
        if self.started:
            self.settle(last=True)
        self.boundary.landed()  # the last checkpoint has landed before the run says it finished
        self.boundary.restore(self.step)  # a resumed run with nothing left to do checks what it resumed
        self.boundary.said_saves()

    def _leave_finished(self, saved: dict) -> None:
        """A finished run resumed by another command whose loop ran no step (no more epochs than it
        ran): every registered object gets the checkpoint's state, rank 0 says so in one line,
        and the run closes as finished with no collective and no checkpoint (Run writes no
        OUT/NAME.pt either), so a rank whose code after the loop failed leaves the others nothing
        to wait for."""
        taken = self.session.take_saved()
        assert taken is not None, "a finished run's checkpoint is restored once"
        checkpoints.restore_run(*taken, self.boundary.objects, self.models, self.env, self.step, check=False)
        if self.env.is_rank0:
            print(resume.trained_nothing(self.out or taken[0], saved, self.steps), flush=True)
        self.close(plot=True)  # its trackers' runs end as finished; loss.png is drawn again, alike

    def close(self, plot: bool = False) -> None:
        """Stop the diagnostics and leave the process group without another collective."""
        if self.closed:
            return
        self.closed = True
        self.boundary.preemption.restore()
        if self.grains is not None:
            self.grains.restore_kernels()  # bitwise's kernel settings, as the run found them
        self.monitor.close(plot)
        self.session.leave()

    def _preempted(self, number: int) -> None:
        """Every rank, once all agree a signal came: checkpoint this step, leave, and exit."""
        boundary = self.boundary
        if self.out is not None and boundary.saved_step != self.step:
            if boundary.replicas.pending:
                boundary.replicas.finish()
            boundary.checkpoint(self.step, self.epoch, self.outside)
        boundary.landed()  # the checkpoint has landed before the process exits
        self.monitor.flush()  # written already when the step was checkpointed just now
        self.close()
        exit_preempted(number, self.step, self.out is not None, self.env.is_rank0)
