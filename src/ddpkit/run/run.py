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

import atexit
import dataclasses
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddpkit.checkpoint.lock import OutLock
from ddpkit.dist import current_env, init_distributed
from ddpkit.dist.init import DEFAULT_TIMEOUT, set_collective_timeout
from ddpkit.errors import ConfigError
from ddpkit.logs import setup_logging
from ddpkit.run import state
from ddpkit.run.config import RunConfig, split_options
from ddpkit.run.end import RunEnd
from ddpkit.run.engine import local_forwards, unwrap, wrap
from ddpkit.run.evaluate import evaluate
from ddpkit.run.loader import Loader
from ddpkit.run.monitor import Monitor
from ddpkit.run.optim import gate
from ddpkit.run.preempt import Preemption
from ddpkit.run.setup import (
    check_same_model,
    check_split,
    kind_of,
    load_weights,
    loader_parts,
    make_sampler,
    seed_everything,
)
from ddpkit.run.steps import StepCycle
from ddpkit.run.stream import StreamLoader, is_stream

log = logging.getLogger(__name__)


class Run(RunEnd):
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
        out, seed, backend, steps: the run's own settings; see ``ddpkit.run.RunConfig``.
        **options: component settings by name: data (``global_batch``, ``micro_batch``,
            ``drop_last``, ``shuffle``), engine (``engine``, ``bucket_cap_mb``,
            ``find_unused_parameters``, ``compression``, ``sync_batchnorm``, ``broadcast_buffers``,
            ``precision``), checkpoints (``save_every``, ``keep_last``, ``resume``), optimizer
            step (``grad_clip``, ``on_nonfinite``) and diagnostics (``log_every``,
            ``check_every``, ``rank_table_every``, ``collective_timeout``, ``progress``, ``trackers``);
            see the config classes in ``ddpkit.run``.
    """

    def __init__(
        self,
        out: str | Path | None = None,
        *,
        seed: int = 0,
        backend: str = "auto",
        steps: int | None = None,
        **options: Any,
    ) -> None:
        self.data_cfg, self.engine_cfg, self.ckpt_cfg, self.optim_cfg, self.diag_cfg = split_options(options)
        self.cfg = RunConfig(str(out) if out is not None else None, seed, backend, steps)
        if out is None and self.ckpt_cfg.save_every:
            raise ConfigError(f"save_every={self.ckpt_cfg.save_every} needs out=FOLDER for its checkpoints")
        self.out, self.seed = (Path(out) if out is not None else None), seed
        # A script that joined a process group itself keeps it: the run neither creates nor destroys it.
        self._owns_group = not torch.distributed.is_initialized()
        self.env = self._join(backend) if self._owns_group else current_env()
        self.device = self.env.device
        setup_logging(self.env)
        seed_everything(seed)
        self.models: dict[str, nn.Module] = {}  # name -> the wrapped model the user calls
        self.objects: dict[str, Any] = {}  # name -> what a checkpoint holds (bare models too)
        self.train_loader: Loader | None = None
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.engine_cfg.precision == "fp16")
        if self.scaler.is_enabled():  # its scale and growth tracker resume with the run
            self.objects["grad_scaler"] = self.scaler
        self._lock = OutLock(self.out) if self.out is not None and self.env.is_rank0 else None
        try:
            self._resume_path = state.resume_point(self.out, self.ckpt_cfg, self.env, self._lock)
            self._saved = state.load(self._resume_path, self.device) if self._resume_path else None
            configs = (self.cfg, self.data_cfg, self.engine_cfg, self.ckpt_cfg, self.optim_cfg, self.diag_cfg)
            params = {k: v for cfg in configs for k, v in dataclasses.asdict(cfg).items()}  # for trackers
            self.monitor = Monitor(self.env, self.diag_cfg, self.out, params)
        except BaseException:
            self._leave()  # the folder's lock and the process group, so nothing is left behind
            raise
        self._preemption = Preemption(self.ckpt_cfg.preempt_signals, _collective_device(self.env))
        self.cycle = StepCycle(
            self.env, self.monitor, self.models, self.objects, self.out, self.ckpt_cfg, self.optim_cfg,
            self.scaler, steps, self._saved["step"] if self._saved is not None else 0,
            self._preemption, self._preempted,
        )  # fmt: skip
        self._finished = False
        atexit.register(self._finish_at_exit)

    def _join(self, backend: str):
        """Join with the start-up timeout, then give collectives theirs: the backend's own timeout
        comes after the watchdog's report, which explains what the backend's error would not."""
        diag = self.diag_cfg
        env = init_distributed(backend, timeout=timedelta(seconds=diag.startup_timeout))
        after = diag.collective_timeout + 120 if diag.collective_timeout else DEFAULT_TIMEOUT.total_seconds()
        set_collective_timeout(timedelta(seconds=after))
        return env

    # --- registration -----------------------------------------------------------------------

    def setup(
        self, model: nn.Module, *optimizers: torch.optim.Optimizer, name: str | None = None
    ) -> nn.Module:
        """Place ``model`` on this rank's device and wrap it in the engine; returns the wrapped model.

        Every rank must build the same model; ddpkit checks it (shapes and values) before
        wrapping. When the run resumes, the model's weights are the checkpoint's. The model is
        checkpointed under ``name`` ("model", then "model2", ...), and ``finish`` writes its
        weights to OUT/NAME.pt. ``optimizers`` (built over its parameters) are tracked as by
        ``track``.
        """
        name = self._new_name(name, "model")
        check_same_model(model, self.env)
        if self._saved is not None and name in self._saved["state"]:
            load_weights(unwrap(model), self._saved["state"][name], name, self._resume_path)
        self.monitor.watch(model)  # before the engine's hooks, which wait for the all-reduce
        wrapped = wrap(model, self.env, self.engine_cfg)
        self.models[name], self.objects[name] = wrapped, unwrap(wrapped)
        self.track(*optimizers)
        return wrapped

    def track(self, *objects: Any, **named: Any) -> None:
        """Checkpoint these objects with the run: optimizers, LR schedulers, GradScalers, or anything
        with ``state_dict()`` and ``load_state_dict()``. Optimizers and schedulers then step once per
        global batch: on earlier micro-batches ``step()`` waits, ``zero_grad()`` keeps the gradients."""
        for obj in objects:
            named[self._new_name(None, kind_of(obj))] = obj
        for name, obj in named.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(
                    f"run.track({name}=...) needs state_dict() and load_state_dict(); "
                    f"got {type(obj).__name__}"
                )
            self._new_name(name, name)
            gate(obj, self.cycle)
            if self.cycle.lr_optimizer is None and isinstance(obj, torch.optim.Optimizer):
                self.cycle.lr_optimizer = obj  # metrics lines show its learning rate
            self.objects[name] = obj

    def loader(self, data: Dataset | DataLoader, **dataloader_kwargs: Any) -> Loader:
        """A DataLoader over ``data`` that yields this rank's micro-batches, on the device.

        ``len(loader)`` is the optimizer steps of one epoch, the same at every point of the run.

        Args:
            data: a map-style Dataset (``ddpkit.data.Shards`` for sharded files), a stream (an
                IterableDataset, a HuggingFace streaming dataset, any iterable: see
                ``ddpkit.run.stream``), or a DataLoader over either, whose dataset, batch_size (as
                the global batch when the run sets none), collate_fn and worker settings are taken over.
            **dataloader_kwargs: num_workers, collate_fn, pin_memory, persistent_workers,
                prefetch_factor, worker_init_fn, multiprocessing_context, as for torch's DataLoader.
        """
        if self.train_loader is not None:
            raise ConfigError(
                "a run has one training loader; evaluate other data with run.evaluate(dataset, fn)"
            )
        dataset, global_batch, kwargs, shuffle = loader_parts(
            data, self.data_cfg, self.device, dataloader_kwargs
        )
        if is_stream(dataset):
            check_split(global_batch, self.env.world_size)
            self.train_loader = StreamLoader(self, dataset, global_batch, self.data_cfg.micro_batch, kwargs)
        else:
            sampler = make_sampler(dataset, global_batch, self.env, self.data_cfg, self.seed, shuffle)
            self.train_loader = Loader(self, dataset, sampler, self.data_cfg.micro_batch, kwargs)
        self._new_name("loader", "loader")
        self.objects["loader"] = self.train_loader
        if self._saved is not None and "loader" in self._saved["state"]:
            self.train_loader.load_state_dict(self._saved["state"]["loader"])
        return self.train_loader

    def _new_name(self, name: str | None, kind: str) -> str:
        if name is None:
            taken = sum(
                1 for n in self.objects if n == kind or n.startswith(kind) and n[len(kind) :].isdigit()
            )
            name = kind if taken == 0 else f"{kind}{taken + 1}"
        if name in self.objects:
            raise ConfigError(f"the run already tracks an object named {name!r}; give this one another name")
        if self.monitor.bar is not None:
            raise ConfigError(
                f"register {name!r} before the first batch: a resumed run restores everything then"
            )
        return name

    # --- the step ------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for the mean loss of one micro-batch, scaled to its share of the step.

        Inside a ``run.loader`` loop the gradient becomes that of the mean over the global batch
        (at any world size); outside one it is a plain backward. Every call's loss is logged.
        """
        micro = self.cycle.micro
        scale = micro.scale if micro is not None else 1.0
        if micro is not None:
            self.monitor.window.add_loss(loss, micro.samples)
        self.cycle.has_backward = True
        self.cycle.held.restore()  # the step's earlier micro-batches' gradients, to add to
        self.monitor.clock.backward(self.scaler.scale(loss * scale if scale != 1.0 else loss))
        if micro is not None and not micro.last:
            # Until the step's last backward, p.grad is None: a clip_grad_norm_ or any other edit
            # the user's loop makes before optimizer.step() then acts on the whole step's
            # all-reduced gradient, as without micro_batch, never on a partial local one.
            self.cycle.held.hold()

    def log(self, **metrics: float | torch.Tensor) -> None:
        """Record metrics: in a step, for the metrics line, which holds their mean over ranks and the
        steps since the last line; between steps (after an epoch, say an eval), for a line of their
        own, with the step they follow, written before the next step, checkpoint or the run's end.
        Any subset of ranks may log; a value is written once."""
        for name, value in metrics.items():
            self.monitor.add_user(name, value, between=not self.cycle.open)

    def save(self) -> None:
        """Checkpoint at the end of the current step (now, between epochs). All ranks call it."""
        self.cycle.save_now = True
        if not self.cycle.open:
            self.cycle.checkpoint()

    def evaluate(self, dataset: Dataset, fn: Any, **kwargs: Any) -> dict[str, float]:
        """Exact mean (``reduce="sum"``: sum) over ``dataset`` of what ``fn(batch)`` returns per
        batch: a mean-over-the-batch tensor, or a dict of them. Each sample counts once; shards are
        uneven, nothing is padded. Models are in eval mode and no gradient is kept meanwhile."""
        self.monitor.phase(self.step, "eval: metric sums all_gather")
        with local_forwards(list(self.models.values())):
            return evaluate(dataset, fn, self.env, list(self.models.values()), **kwargs)

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
    def step(self) -> int:
        """Optimizer steps begun (inside the loop, the running one counts); a resume starts at its own."""
        return self.cycle.step

    @property
    def at_step_end(self) -> bool:
        """True after a step's last micro-batch came out of the loader: the step is complete once
        the optimizer steps, and a collective here (``run.evaluate``) is reached by every rank."""
        micro = self.cycle.micro
        return micro is not None and micro.last

    def _fetch(self, batches: Any) -> Any:
        start = time.perf_counter()
        batch = next(batches)
        self.monitor.data(start)
        return batch

    def _start_epoch(self) -> None:
        if self.monitor.bar is None:  # the loop's first batch: a resumed run restores everything now
            self._restore()
            self.monitor.start(self.step, self.cycle.steps)

    def _restore(self) -> None:
        if self._saved is not None:
            self.cycle.restore(self._resume_path, self._saved)
            self._saved = None

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.env.is_rank0:
            print(*args, **kwargs, flush=True)


def _collective_device(env) -> torch.device:
    return env.device if env.backend == "nccl" else torch.device("cpu")
