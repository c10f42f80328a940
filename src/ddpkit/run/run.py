"""``ddpkit.Run``: the front door for a user's own training loop.

State machine of one process's run (``step`` counts optimizer steps begun)::

    created --setup/track/loader--> registered --first batch: restore, check--> stepping
    stepping --each step's first micro-batch: finish the previous step (position, log,
               check, checkpoint), begin the next--> stepping
    stepping --finish(): finish the last step, final checkpoint, OUT/model.pt--> finished

Every collective (log lines, fingerprints, checkpoints) happens at a step boundary that every
rank reaches in the same order, so a loop the user writes once cannot make ranks disagree.
"""

from __future__ import annotations

import logging
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddpkit.diagnostics import check_replicas_agree
from ddpkit.dist import destroy, init_distributed
from ddpkit.errors import ConfigError
from ddpkit.logs import setup_logging
from ddpkit.run import state
from ddpkit.run.config import split_options
from ddpkit.run.engine import local_forwards, set_grad_sync, unwrap, wrap
from ddpkit.run.evaluate import evaluate
from ddpkit.run.loader import Loader, Micro
from ddpkit.run.monitor import Monitor
from ddpkit.run.optim import gate, optimizer_params, total_norm
from ddpkit.run.setup import check_same_model, loader_parts, make_sampler, save_weights

log = logging.getLogger(__name__)


class Run:
    """One training run, seen from one process: process group, engine, data, checkpoints, diagnostics.

    Reads what the launcher set (torchrun, ``ddpkit run``, SLURM, ``ddpkit.launch``, or nothing:
    a world of one), joins the process group and seeds python, numpy and torch with ``seed`` on
    every rank. A single-device loop becomes data-parallel with these calls::

        run = ddpkit.Run(out="runs/mine", global_batch=64, micro_batch=16, save_every=100)
        model = run.setup(Net())                      # on the device, wrapped, rank 0's weights
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        run.track(optimizer=optimizer)                # checkpointed; steps once per global batch
        loader = run.loader(dataset, num_workers=2)   # this rank's micro-batches of each step
        for epoch in range(loader.epoch, 10):         # resumes mid-epoch where it stopped
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)   # the usual mean over the micro-batch
                optimizer.zero_grad()
                run.backward(loss)
                optimizer.step()
        run.finish()                                  # final log and checkpoint, OUT/model.pt

    One step is one global batch whatever the world size: each rank takes its slice, splits it
    into micro-batches, and ``run.backward`` scales each micro-batch's mean loss so that the
    averaged gradient is the gradient of the mean over the global batch (the last, partial batch
    of an epoch included). The micro-batches before a step's last run without communication.
    What cannot be invariant: BatchNorm's batch statistics are computed per micro-batch on each
    rank, so a model with BatchNorm sees other statistics when the world size or micro-batch
    changes; the running statistics are rank 0's (broadcast before each forward).

    Args:
        out: folder for checkpoints, metrics.jsonl, loss.png, model.pt and hang reports; None
            writes nothing (and allows no checkpoints).
        seed: seeds every generator, the same on every rank, and the data order.
        backend: ``auto`` (nccl with a GPU per process, else gloo), ``gloo``, ``nccl`` or ``mpi``.
        steps: stop the loader after this many optimizer steps (None: run the epochs you loop over).
        startup_timeout: seconds to wait for every rank to join the process group.
        **options: component settings by name: data (``global_batch``, ``micro_batch``,
            ``drop_last``, ``shuffle``), engine (``engine``, ``bucket_cap_mb``,
            ``find_unused_parameters``, ``compression``, ``sync_batchnorm``, ``broadcast_buffers``,
            ``precision``), checkpoints (``save_every``, ``keep_last``, ``resume``), optimizer
            step (``grad_clip``, ``on_nonfinite``) and diagnostics (``log_every``,
            ``check_every``, ``rank_table_every``, ``collective_timeout``, ``progress``);
            see the config classes in ``ddpkit.run``.
    """

    def __init__(
        self,
        out: str | Path | None = None,
        *,
        seed: int = 0,
        backend: str = "auto",
        steps: int | None = None,
        startup_timeout: float = 1800.0,
        **options: Any,
    ) -> None:
        self.data_cfg, self.engine_cfg, self.ckpt_cfg, self.optim_cfg, self.diag_cfg = split_options(options)
        if steps is not None and steps < 1:
            raise ConfigError(f"steps={steps} is below 1; use a positive number, or None to loop over epochs")
        if out is not None and not str(out).strip():
            raise ConfigError("out='' names no folder; pass a folder such as 'runs/mine', or None for no files")
        if out is None and self.ckpt_cfg.save_every:
            raise ConfigError(f"save_every={self.ckpt_cfg.save_every} needs out=FOLDER to write checkpoints into")
        self.out, self.seed, self.steps = (Path(out) if out is not None else None), seed, steps
        timeout = max(startup_timeout, self.diag_cfg.collective_timeout + 120)  # the report comes first
        self.env = init_distributed(backend, timeout=timedelta(seconds=timeout))
        self.device = self.env.device
        setup_logging(self.env)
        _seed_everything(seed)
        self.step = 0
        self.models: dict[str, nn.Module] = {}  # name -> the wrapped model the user calls
        self.objects: dict[str, Any] = {}  # name -> what a checkpoint holds (bare models too)
        self.train_loader: Loader | None = None
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.engine_cfg.precision == "fp16")
        self._micro: Micro | None = None
        self._step_indices: list[int] = []
        self._step_open = self._step_has_backward = self._save_now = False
        self._resume_path = state.resume_point(self.out, self.ckpt_cfg, self.env)
        self._saved = state.load(self._resume_path, self.device) if self._resume_path else None
        if self._saved is not None:
            self.step = self._saved["step"]
        self._saved_step = self.step  # no checkpoint to write before a step is taken
        self.monitor = Monitor(self.env, self.diag_cfg, self.out)
        self.skipped_steps = 0

    # --- registration -----------------------------------------------------------------------

    def setup(self, model: nn.Module, *, name: str | None = None) -> nn.Module:
        """Place ``model`` on this rank's device and wrap it in the engine; returns the wrapped model.

        Every rank must build the same model; ddpkit checks it (shapes and values) before
        wrapping. When the run resumes, the model's weights are the checkpoint's. The model is
        checkpointed under ``name`` ("model", then "model2", ...), and ``finish`` writes its
        weights to OUT/NAME.pt.
        """
        name = self._new_name(name, "model")
        check_same_model(model, self.env)
        if self._saved is not None and name in self._saved["state"]:
            model.load_state_dict(self._saved["state"][name])
        wrapped = wrap(model, self.env, self.engine_cfg)
        self.monitor.watch(model)
        self.models[name], self.objects[name] = wrapped, unwrap(wrapped)
        return wrapped

    def track(self, *objects: Any, **named: Any) -> None:
        """Checkpoint these objects with the run: optimizers, LR schedulers, GradScalers, or anything
        with ``state_dict()`` and ``load_state_dict()``. Optimizers and schedulers then step once per
        global batch: on earlier micro-batches ``step()`` waits, ``zero_grad()`` keeps the gradients."""
        for obj in objects:
            named[self._new_name(None, _kind(obj))] = obj
        for name, obj in named.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"run.track({name}=...) needs state_dict() and load_state_dict(); got {type(obj).__name__}")
            self._new_name(name, name)
            gate(obj, self)
            self.objects[name] = obj

    def loader(self, data: Dataset | DataLoader, **dataloader_kwargs: Any) -> Loader:
        """A DataLoader over ``data`` that yields this rank's micro-batches, on the device.

        Args:
            data: a map-style Dataset, or a DataLoader whose dataset, batch_size (as the global
                batch when the run sets none), collate_fn and worker settings are taken over.
            **dataloader_kwargs: num_workers, collate_fn, pin_memory, persistent_workers,
                prefetch_factor, worker_init_fn, multiprocessing_context, as for torch's DataLoader.
        """
        if self.train_loader is not None:
            raise ConfigError("a run has one training loader; evaluate other data with run.evaluate(dataset, fn)")
        dataset, global_batch, kwargs, shuffle = loader_parts(data, self.data_cfg, self.device, dataloader_kwargs)
        sampler = make_sampler(dataset, global_batch, self.env, self.data_cfg, self.seed, shuffle)
        self.train_loader = Loader(self, dataset, sampler, self.data_cfg.micro_batch, kwargs)
        self._new_name("loader", "loader")
        self.objects["loader"] = self.train_loader
        if self._saved is not None and "loader" in self._saved["state"]:
            self.train_loader.load_state_dict(self._saved["state"]["loader"])
        return self.train_loader

    def _new_name(self, name: str | None, kind: str) -> str:
        if name is None:
            taken = sum(1 for n in self.objects if n == kind or n.startswith(kind) and n[len(kind) :].isdigit())
            name = kind if taken == 0 else f"{kind}{taken + 1}"
        if name in self.objects:
            raise ConfigError(f"the run already tracks an object named {name!r}; give this one another name")
        if self._step_open or self.monitor.bar is not None:
            raise ConfigError(f"register {name!r} before the first batch: a resumed run restores everything then")
        return name

    # --- the step ------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for the mean loss of one micro-batch, scaled to its share of the step.

        Inside a ``run.loader`` loop the gradient becomes that of the mean over the global batch
        (at any world size); outside one it is a plain backward. Every call's loss is logged.
        """
        micro = self._micro
        scale = micro.scale if micro is not None else 1.0
        if micro is not None:
            self.monitor.window.add(loss.detach().float() * micro.samples, 0)
        self._step_has_backward = True
        start = time.perf_counter()
        self.scaler.scale(loss * scale if scale != 1.0 else loss).backward()
        self.monitor.backward(start)

    def log(self, **metrics: float | torch.Tensor) -> None:
        """Record metrics for this step; each metrics line holds their mean over ranks and steps."""
        for name, value in metrics.items():
            self.monitor.add_user(name, value)

    def save(self) -> None:
        """Checkpoint at the end of the current step (now, between epochs). All ranks call it."""
        self._save_now = True
        if not self._step_open:
            self._checkpoint()

    def evaluate(self, dataset: Dataset, fn: Any, **kwargs: Any) -> dict[str, float]:
        """Exact mean (``reduce="sum"``: sum) over ``dataset`` of what ``fn(batch)`` returns per
        batch: a mean-over-the-batch tensor, or a dict of them. Each sample counts once; shards are
        uneven, nothing is padded. Models are in eval mode and no gradient is kept meanwhile."""
        self.monitor.phase(self.step, "eval: metric sums all_gather")
        with local_forwards(list(self.models.values())):
            return evaluate(dataset, fn, self.env, list(self.models.values()), **kwargs)

    def _accumulating(self) -> bool:
        return self._micro is not None and not self._micro.last

    def _fetch(self, batches: Any) -> Any:
        start = time.perf_counter()
        batch = next(batches)
        self.monitor.data(start)
        return batch

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, step: Any, closure: Any) -> Any:
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)  # clip and check the true gradient
        norm = total_norm(optimizer_params(optimizer), self.optim_cfg.grad_clip)
        if self.scaler.is_enabled():  # the GradScaler skips non-finite steps itself
            optimizer._ddpkit_inner = True
            try:
                return self.scaler.step(optimizer)
            finally:
                optimizer._ddpkit_inner = False
        # The norm is of the all-reduced gradient, the same on every rank: all decide alike.
        if torch.isfinite(norm):
            return step(closure)
        if self.optim_cfg.on_nonfinite == "stop":
            raise FloatingPointError(
                f"step {self.step}: the gradient norm is {norm.item()} on every rank; lower the learning "
                "rate or check the data, or pass on_nonfinite='skip' to skip such steps"
            )
        self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        log.warning("step %d: gradient norm is %s; optimizer step skipped", self.step, norm.item())
        return None

    # --- step boundaries (called by the loader) -------------------------------------------------

    def _start_epoch(self, loader: Loader) -> None:
        if self.monitor.bar is None:
            self._restore()
            self.monitor.start(self.step, self.steps)

    def _begin_step(self) -> bool:
        self._finish_step()
        if self.steps is not None and self.step >= self.steps:
            return False
        self.step += 1
        self._step_open, self._step_has_backward, self._step_indices = True, False, []
        self.monitor.phase(self.step, "forward/backward: gradient all-reduce")
        return True

    def _enter_micro(self, micro: Micro) -> None:
        self._micro = micro
        self.monitor.window.samples += micro.samples
        if micro.samples:
            self._step_indices += micro.indices
        if micro.first or micro.last:  # no_sync on all but the step's last micro-batch
            set_grad_sync(list(self.models.values()), micro.last)

    def _end_epoch(self) -> None:
        self._finish_step()

    def _finish_step(self, last: bool = False) -> None:
        """Close the open step (its position, log line, fingerprint check, checkpoint)."""
        ended = self._step_open
        if ended:
            self.scaler.update()
            self.train_loader.sampler.advance_to(self._micro.consumed)
            self.monitor.samples_taken(self.step, self._step_indices)
            self._micro, self._step_open, self._step_has_backward = None, False, False
        last = last or (self.steps is not None and self.step >= self.steps)
        if not ended and not last:
            return
        extra = {"epoch": self.train_loader.epoch if self.train_loader else 0, "skipped_steps": self.skipped_steps}
        self.monitor.step_done(self.step, ended, last, {**extra, **self._lrs()})
        if self.diag_cfg.check_every and ended and (self.step % self.diag_cfg.check_every == 0 or last):
            self.monitor.phase(self.step, "check: replica fingerprint all_gather")
            for name, model in self.models.items():
                check_replicas_agree(unwrap(model), self.env, f"at step {self.step} ({name})", buffers=False)
        every = self.ckpt_cfg.save_every
        due = every and (self.step % every == 0 or last)
        if (self._save_now or due) and self._saved_step != self.step:
            self._checkpoint()

    def _lrs(self) -> dict:
        optimizers = [o for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)]
        return {"lr": optimizers[0].param_groups[0]["lr"]} if optimizers else {}

    def _checkpoint(self) -> None:
        if self.out is None:
            raise ConfigError("run.save() needs out=FOLDER to write the checkpoint into")
        self._save_now, self._saved_step = False, self.step
        self.monitor.phase(self.step, "checkpoint: RNG states all_gather_object")
        path = state.save(self.out / "checkpoints", self.step, self.objects, self.env, self.ckpt_cfg.keep_last)
        if path is not None:
            log.info("saved %s", path)

    def _restore(self) -> None:
        """At the first batch: every registered object gets its part of the checkpoint."""
        if self._saved is None:
            return
        state.check_names(self._resume_path, self._saved["state"], list(self.objects))
        state.restore(self.objects, self._saved, self.env.rank)
        for name, model in self.models.items():
            check_replicas_agree(unwrap(model), self.env, f"after loading {self._resume_path} ({name})")
        if self.env.is_rank0:
            print(f"ddpkit: resumed from {self._resume_path} at step {self.step}", flush=True)
        self._saved = None

    # --- the end ----------------------------------------------------------------------------------

    def finish(self) -> None:
        """Finish the last step (its log line and checkpoint), write OUT/NAME.pt for every model on
        rank 0, draw OUT/loss.png, and leave the process group. All ranks call it."""
        if self.monitor.bar is not None:  # the loop ran: close its last step as the run's last
            self._finish_step(last=True)
        self._restore()  # a resumed run that had nothing left to do still checks what it resumed
        if self.env.is_rank0 and self.out is not None:
            for name, model in self.models.items():
                save_weights(unwrap(model), self.out / f"{name}.pt")
        self.close(plot=True)

    def close(self, plot: bool = False) -> None:
        """Stop the diagnostics and leave the process group without another collective (after an error)."""
        self.monitor.close(plot)
        destroy()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self.finish() if kind is None else self.close()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.env.is_rank0:
            print(*args, **kwargs, flush=True)


def _kind(obj: Any) -> str:
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
        return "scheduler"
    return "scaler" if isinstance(obj, torch.amp.GradScaler) else type(obj).__name__.lower()


def _seed_everything(seed: int) -> None:
    """The same seed on every rank: identical model init, so the engine's broadcast changes nothing."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
