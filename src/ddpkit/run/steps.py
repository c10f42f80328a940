"""The step cycle of a Run: what happens between micro-batches and at each step boundary.

The training loader drives it. At a step's first micro-batch the previous step is closed:
the loader's position moves to what that step consumed, the metrics line is written when due,
replicas are fingerprinted when due, and a checkpoint is written when due. Every one of those
collectives happens at the same boundary on every rank. Between micro-batches the cycle tells
the engines whether the next backward synchronizes (only a step's last does) and the gated
optimizers whether to step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.diagnostics import check_replicas_agree
from ddpkit.diagnostics.fingerprint import fingerprint
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.run import state
from ddpkit.run.engine import set_grad_sync, unwrap
from ddpkit.run.loader import Loader, Micro
from ddpkit.run.monitor import Monitor
from ddpkit.run.optim import OptimConfig, optimizer_params, total_norm
from ddpkit.run.preempt import Preemption
from ddpkit.run.state import CheckpointConfig

log = logging.getLogger(__name__)


class StepCycle:
    """One rank's position in the run: the step, the micro-batch, and what each boundary does.

    Args:
        env: this process's distributed environment.
        monitor: timings, metrics lines and the hang watchdog's phases.
        models: name -> wrapped model, filled by ``Run.setup``.
        objects: name -> what a checkpoint holds, filled by ``Run.setup/track/loader``.
        out: the run's folder (None: no files).
        ckpt_cfg: when to checkpoint.
        optim_cfg: clipping and non-finite gradients.
        scaler: the fp16 GradScaler (disabled otherwise).
        steps: the last step to run, or None.
        step: the step the run starts after (a resumed checkpoint's).
        preemption: the signal handlers; when every rank agrees one arrived, the step is
            checkpointed and ``on_preempt(signal, step)`` ends the process.
        on_preempt: called on every rank after the preemption checkpoint.
    """

    def __init__(
        self, env: DistEnv, monitor: Monitor, models: dict[str, nn.Module], objects: dict[str, Any],
        out: Path | None, ckpt_cfg: CheckpointConfig, optim_cfg: OptimConfig,
        scaler: torch.amp.GradScaler, steps: int | None, step: int,
        preemption: Preemption, on_preempt: Callable[[int, int], None],
    ) -> None:  # fmt: skip
        self.env, self.monitor, self.models, self.objects, self.out = env, monitor, models, objects, out
        self.ckpt_cfg, self.optim_cfg, self.scaler, self.steps = ckpt_cfg, optim_cfg, scaler, steps
        self.step, self.saved_step, self.skipped_steps = step, step, 0
        self.last_lr: float | None = None  # the first optimizer's rate at its last real step
        self.lr_optimizer: torch.optim.Optimizer | None = None  # the first tracked, set by Run.track
        self.loader: Loader | None = None
        self.micro: Micro | None = None
        self.open = self.has_backward = self.save_now = False
        # Between steps: before the loop's first and after each epoch's last. Every rank is there at
        # the same points, so run.log values from there are gathered for a line of their own.
        self.outside = True
        self.epoch = 0  # the epoch of the last step begun
        self.held = HeldGrads(models)
        self.indices: list[int] = []
        self.preemption, self.on_preempt = preemption, on_preempt
        self.replicas = ReplicaCheck(env, monitor, models)

    @property
    def accumulating(self) -> bool:
        """True on a step's micro-batches before its last: optimizers and schedulers wait."""
        return self.micro is not None and not self.micro.last

    def begin(self, loader: Loader) -> bool:
        """Close the previous step and open the next; False once the run's last step is done."""
        self.finish()
        if self.steps is not None and self.step >= self.steps:
            self.outside = True
            return False
        if self.outside:
            self.flush_between()
            self.outside = False
        self.epoch = loader.epoch
        self.loader, self.step = loader, self.step + 1
        self.open, self.has_backward, self.indices = True, False, []
        self.monitor.phase(self.step, "forward/backward: gradient all-reduce")
        return True

    def enter(self, micro: Micro) -> None:
        """The loop is about to get ``micro``'s batch."""
        self.micro = micro
        self.monitor.window.samples += micro.samples
        if micro.samples and self.monitor.cfg.log_samples:
            self.indices += micro.indices
        if micro.first or micro.last:  # no_sync on all but the step's last micro-batch
            set_grad_sync(self.models.values(), micro.last)

    def finish(self, last: bool = False) -> None:
        """Close the open step (its position, log line, fingerprint check, checkpoint)."""
        ended = self.open
        if ended:
            self.held.restore()  # a loop left mid-step: the gradients are the user's again
            self.scaler.update()
            self.loader._advance_to(self.micro.consumed)
            self.monitor.samples_taken(self.step, self.indices)
            self.micro, self.open, self.has_backward = None, False, False
        last = last or (self.steps is not None and self.step >= self.steps)
        if not ended and not last:
            return
        # The signal rides on the log gather, which is read at the next step's end: every rank
        # then reads the same maximum, so all stop at that step.
        logged = self.monitor.step_done(self.step, ended, last, self._extra, self.preemption.received)
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
        save = due and self.saved_step != self.step
        check_every = self.monitor.check_every
        if check_every and ended and (self.step % check_every == 0 or last):
            self.replicas.start(self.step)
            if last or save:  # nothing follows to finish it; a checkpoint holds checked replicas only
                self.replicas.finish()
        if save:
            self.checkpoint()
        if not ended or last:
            return
        if not number and self.monitor.logged_step != self.step:  # else it rides on this step's gather
            number = self.preemption.agreed(self.step)
        if number:
            if self.out is not None and self.saved_step != self.step:
                if self.replicas.pending:
                    self.replicas.finish()
                self.checkpoint()
            self.monitor.flush()  # written already when the step was checkpointed just now
            self.on_preempt(number, self.step)

    def flush_between(self) -> None:
        """Write what run.log got between steps as a line of the last step's. Collective."""
        self.monitor.flush_between(self.step, {"epoch": self.epoch})

    def _pace(self, record: dict) -> None:
        # From the gathered median step, so every rank computes the same pace for the agreement.
        if record["step_s"] > 0:
            self.monitor.pace(record["step_s"])
            self.preemption.pace(record["step_s"], self.monitor.every)

    def _extra(self) -> dict:
        extra = {
            "epoch": self.loader.epoch if self.loader is not None else 0,
            "skipped_steps": self.skipped_steps,
        }
        # The rate the step ran at: a scheduler stepped after the optimizer has set the next one.
        return extra | ({"lr": self.last_lr} if self.last_lr is not None else {})

    def checkpoint(self) -> None:
        """Write every registered object's state at this step. Collective."""
        if self.out is None:
            raise ConfigError("run.save() needs out=FOLDER to write the checkpoint into")
        self.save_now, self.saved_step = False, self.step
        # The step's log lines first: a run killed after this checkpoint resumes after them.
        self.monitor.flush()
        if self.outside:
            self.flush_between()
        self.monitor.phase(self.step, "checkpoint: RNG states all_gather_object")
        path = state.save(
            self.out / "checkpoints", self.step, self.objects, self.env, self.ckpt_cfg.keep_last
        )
        if path is not None:
            log.info("saved %s", path)

    def restore(self, path: str, saved: dict) -> None:
        """At the loop's first batch: every registered object gets its part of the checkpoint."""
        state.check_names(path, saved["state"], list(self.objects))
        state.restore(self.objects, saved, self.env.rank)
        for name, model in self.models.items():
            check_replicas_agree(unwrap(model), self.env, f"after loading {path} ({name})")
        if self.env.is_rank0:
            print(f"ddpkit: resumed from {path} at step {self.step}", flush=True)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Any, closure: Any) -> Any:
        """A gated optimizer's real step: unscale, clip, and stop or skip on a non-finite norm."""
        if self.last_lr is None or optimizer is self.lr_optimizer:
            self.last_lr = optimizer.param_groups[0]["lr"]
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)  # clip and check the true gradient
        norm = total_norm(optimizer_params(optimizer), self.optim_cfg.grad_clip)
        if self.scaler.is_enabled():  # the GradScaler skips non-finite steps itself
            optimizer._ddpkit_inner = True
            try:
                return self.scaler.step(optimizer)
            finally:
                optimizer._ddpkit_inner = False
        # The norm is of the all-reduced gradient, the same on every rank: all decide alike. One
        # .item() is the host sync the decision needs (torch's GradScaler makes the same one), and
        # costs less than torch.isfinite's extra kernel and its bool().
        value = norm.item()
        if math.isfinite(value):
            return step(closure)
        if self.optim_cfg.on_nonfinite == "stop":
            raise FloatingPointError(
                f"step {self.step}: the gradient norm is {value} on every rank; lower the learning "
                "rate or check the data, or pass on_nonfinite='skip' to skip such steps"
            )
        self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        log.warning("step %d: gradient norm is %s; optimizer step skipped", self.step, value)
        return None


class HeldGrads:
    """The gradients of a step's earlier micro-batches, held aside while the user's loop runs.

    ``hold`` after a backward that does not end the step, ``restore`` before the next backward:
    autograd then adds to them as without holding (the same tensors, so an engine's gradient
    views stay its own), and in between every ``p.grad`` of the run's models is None. A gradient
    edit in that gap (a clip_grad_norm_ written for one batch a step) then changes nothing; at the
    step's last micro-batch it sees the whole step's all-reduced gradient, as without micro_batch.
    """

    def __init__(self, models: dict[str, nn.Module]) -> None:
        self.models = models
        self.held: list[tuple[nn.Parameter, torch.Tensor]] = []

    def hold(self) -> None:
        for model in self.models.values():
            for param in unwrap(model).parameters():
                if param.grad is not None:
                    self.held.append((param, param.grad))
                    param.grad = None

    def restore(self) -> None:
        if not self.held:
            return
        held, self.held = self.held, []
        for param, grad in held:
            # A gradient made meanwhile outside run.backward is kept, and added to.
            param.grad = grad if param.grad is None else param.grad.add_(grad)


class ReplicaCheck:
    """Every ``check_every`` steps, all ranks compare parameter fingerprints with rank 0's.

    The fingerprints' all_gather runs in the background and is read at the next step's end (at
    once on the run's last step), so a check step waits for no rank; a replica that drifted
    then stops every rank one step later, naming the step it was seen at.
    """

    def __init__(self, env: DistEnv, monitor: Monitor, models: dict[str, nn.Module]) -> None:
        self.env, self.monitor, self.models = env, monitor, models
        self.pending: list[tuple] = []
        self.step = 0

    def start(self, step: int) -> None:
        self.monitor.phase(step, "check: replica fingerprint all_gather")
        self.step = step
        for name, model in self.models.items():
            names, local = fingerprint(unwrap(model), buffers=False)  # between steps: no buffers
            local = local.to(self.env.device) if self.env.backend == "nccl" else local
            rows = [torch.empty_like(local) for _ in range(self.env.world_size)]
            self.pending.append((name, names, rows, dist.all_gather(rows, local, async_op=True)))

    def finish(self) -> None:
        """Wait for the gathers; raises on every rank if any replica differs from rank 0's."""
        self.monitor.phase(self.step, "check: replica fingerprint all_gather")
        pending, self.pending = self.pending, []
        for name, names, rows, work in pending:
            work.wait()
            table = torch.stack(rows).cpu()  # (world_size, 2 * tensors)
            bad = [rank for rank in range(len(rows)) if not torch.equal(table[rank], table[0])]
            if bad:
                first = int((table[bad[0]] != table[0]).nonzero()[0]) // 2
                raise RuntimeError(
                    f"replicas differ at step {self.step} ({name}): ranks {bad} disagree with rank 0, "
                    f"first at {names[first]!r}; every rank must load the same checkpoint and run the "
                    "same code"
                )
