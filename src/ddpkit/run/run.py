"""``ddpkit.Run``: the front door for a user's own training loop.

A thin facade: it builds the parts (session, monitor, optimizer gate, engine), registers what the
user hands it under a name, and delegates each call of the loop to the step cycle (run/step/cycle.py),
which owns where the run is. Every collective (log lines, fingerprints, checkpoints) happens at a
step boundary every rank reaches in the same order: one loop cannot make ranks disagree.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddpkit.errors import ConfigError
from ddpkit.launch.uncaught import install_excepthook
from ddpkit.run.data.evaluate import evaluate
from ddpkit.run.data.loader import Loader, make_source
from ddpkit.run.engine.wrap import local_forwards, unwrap
from ddpkit.run.invariant.gather import all_gather
from ddpkit.run.main_first import main_first
from ddpkit.run.monitor import notices
from ddpkit.run.parts import build_parts
from ddpkit.run.placement import place_model
from ddpkit.run.state.ema import save_final
from ddpkit.run.state.registry import DictState, kind_of, new_name

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
    into micro-batches, and ``run.backward`` scales each micro-batch's loss so that the averaged
    gradient is that of the mean over the global batch (docs/guarantees.md says what holds and
    what cannot, BatchNorm's batch statistics among them).

    Args:
        out, seed, backend, steps: the run's own settings; see ``ddpkit.run.RunConfig``.
        **options: component settings by name (``global_batch``, ``engine``, ``save_every``,
            ``grad_clip``, ``log_every``, ...): each config class of ``ddpkit.run`` documents its
            own, and docs/api.md lists them all.
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
        install_excepthook()  # an uncaught ConfigError, from here on: one line and exit code 2
        parts = build_parts(out, seed, backend, steps, options)
        self._cfg, self._data_cfg, self._engine_cfg = parts.cfg, parts.data_cfg, parts.engine_cfg
        self._session, self._monitor, self._cycle = parts.session, parts.monitor, parts.cycle
        self._draws, self._scaler, self._best = parts.draws, parts.scaler, parts.best
        self._models, self._objects = parts.models, parts.objects
        self._train_loader: Loader | None = None
        self.out, self.seed = (Path(out) if out is not None else None), seed
        self.env = self._session.env
        self.device = self.env.device
        atexit.register(self._finish_at_exit)

    # --- registration -----------------------------------------------------------------------

    def setup(
        self,
        model: nn.Module,
        *optimizers: torch.optim.Optimizer,
        name: str | None = None,
        weights: str | Path | None = None,
        init: Callable[[nn.Module], object] | None = None,
    ) -> nn.Module:
        """Place ``model`` on this rank's device and wrap it in the engine; returns the wrapped model.

        Every rank must build the same model; ddpkit checks it (shapes and values) before
        wrapping. When the run resumes, the model's weights are the checkpoint's. The model is
        checkpointed under ``name`` ("model", then "model2", ...), and ``finish`` writes its
        weights to OUT/NAME.pt. ``optimizers`` (built over its parameters) are tracked as by
        ``track``. A model built on the meta device gets its values here (``weights=`` a file or
        folder, else each module's ``reset_parameters()`` and ``init(module)``; materialize.py).
        """
        if not isinstance(model, nn.Module):
            raise ConfigError(f"run.setup takes an nn.Module, got {type(model).__name__}: {model!r:.60}")
        name = self._new_name(name, "model")
        parts = (self.env, self._engine_cfg, self._draws, self._monitor, self._cycle.state)
        wrapped = place_model(model, name, self._session, *parts, weights, init)
        self._models[name], self._objects[name] = wrapped, unwrap(wrapped)
        self.track(*optimizers)
        return wrapped

    def track(self, *objects: Any, **named: Any) -> None:
        """Checkpoint these objects with the run: optimizers, LR schedulers, GradScalers, an EMA
        (``ddpkit.EMA``, ``AveragedModel``), anything with ``state_dict()`` and ``load_state_dict()``,
        or a dict of the loop's own state (``best_val``, ``bad_epochs``: restored in place on resume).
        Optimizers, schedulers and an EMA's update then act once per global batch:
        on earlier micro-batches they wait, and ``zero_grad()`` keeps the gradients."""
        for obj in objects:
            named[self._new_name(None, kind_of(obj))] = obj
        for name, obj in named.items():
            obj = DictState(obj) if isinstance(obj, dict) else obj
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(
                    f"run.track({name}=...) needs state_dict() and load_state_dict(); "
                    f"got {type(obj).__name__}"
                )
            self._new_name(name, name)
            self._cycle.gate.track(obj)
            notices.remember_settings(obj)
            self._objects[name] = obj

    def loader(self, data: Dataset | DataLoader, **dataloader_kwargs: Any) -> Loader:
        """A DataLoader over ``data`` that yields this rank's micro-batches, on the device.

        ``len(loader)`` is the optimizer steps of one epoch, the same at every point of the run.

        Args:
            data: a map-style Dataset (``ddpkit.data.Shards`` for sharded files), a stream (an
                IterableDataset, a HuggingFace streaming dataset, any iterable: see
                ``ddpkit.run.data.stream``), or a DataLoader over either, whose every setting is kept
                (shuffle, drop_last, batch_size as the global batch when the run sets none,
                collate_fn, workers) or refused in one line (run/data/from_dataloader.py).
            **dataloader_kwargs: num_workers, collate_fn, pin_memory, persistent_workers,
                prefetch_factor, worker_init_fn, multiprocessing_context, timeout,
                pin_memory_device, in_order (True only), generator, as for torch's DataLoader;
                weights: one per sample, drawn with replacement from (seed, epoch) instead of a shuffle;
                inexact_resume: accept a stream whose state_dict cannot resume it exactly.
        """
        if self._train_loader is not None:
            raise ConfigError(
                "a run has one training loader; evaluate other data with run.evaluate(dataset, fn)"
            )
        source = make_source(data, dataloader_kwargs, self._data_cfg, self.env, self.seed)
        self._new_name("loader", "loader")
        self._objects["loader"] = source
        if (position := self._session.saved_state("loader")) is not None:
            source.load_state_dict(position)  # loader.epoch is the resumed one before the loop
        self._train_loader = Loader(source, self._cycle)
        return self._train_loader

    def _new_name(self, name: str | None, kind: str) -> str:
        name = new_name(self._objects, name, kind)
        if self._cycle.started:
            raise ConfigError(
                f"register {name!r} before the first batch: a resumed run restores everything then"
            )
        return name

    # --- the step ------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, reduction: str = "mean", count: Any = None) -> None:
        """``loss.backward()`` for one micro-batch's loss, scaled so the step is one process's
        update on the whole global batch (at any world size and micro_batch).

        Args:
            loss: the micro-batch's loss: by default its mean over the micro-batch's samples.
            reduction: ``"sum"`` for a loss summed over the samples (``reduction="sum"``).
            count: for a loss summed over ``count`` items (the tokens of a padded batch, the sample
                weights of a class-weighted loss): the step's gradient is then divided by the global
                batch's count, as one process's mean over all of them.

        Outside a ``run.loader`` loop it is a plain backward. Every call's loss is logged, as what
        it is (mean, sum per step, or mean per item).
        """
        self._cycle.backward(loss, reduction, count)

    def log(self, reduce: str = "mean", **metrics: float | torch.Tensor) -> None:
        """Record metrics. In a step, for the metrics line: ``reduce="mean"``, the mean over every
        rank and micro-batch weighted by its samples (a micro-batch's accuracy gives the global
        batch's), averaged over the line's steps; ``reduce="sum"`` (counts), the sum over every rank
        and micro-batch per step. Between steps (after an epoch, say an eval), for a line of their
        own with the step they follow: the mean (or sum) of the values the ranks logged, written
        before the next step, checkpoint or the run's end. A rank without samples in an epoch's last
        batch counts for nothing; any subset of ranks may log; a value is written once."""
        self._cycle.log(metrics, reduce)

    def save(self) -> None:
        """Checkpoint at the end of the current step (now, between epochs). All ranks call it."""
        self._cycle.request_save()

    def save_best(self, value: float | torch.Tensor, mode: str = "min") -> bool:
        """Write every model's weights to ``OUT/best.pt`` when ``value`` (a validation loss, or with
        ``mode="max"`` an accuracy) beats the best so far, and checkpoint this step; True if it did.
        All ranks call it (run/state/best.py)."""
        models = {name: unwrap(model) for name, model in self._models.items()}
        if better := self._best.offer(value, mode, self.step, models, self.out, self.env):
            self._cycle.request_save()
        return better

    def evaluate(self, dataset: Dataset, fn: Any, **kwargs: Any) -> dict[str, float]:
        """Exact mean (``reduce="sum"``: sum) over ``dataset`` of ``fn(batch)``, a batch's mean (or a
        dict of them), each sample once, models in eval mode, draws seeded per sample (evaluate.py)."""
        self._monitor.phase(self._cycle.step, "eval: metric sums all_gather")
        with local_forwards(list(self._models.values())):
            return evaluate(dataset, fn, self.env, list(self._models.values()), seed=self.seed, **kwargs)

    def main_first(self, local: bool = False) -> contextlib.AbstractContextManager[None]:
        """A block rank 0 runs first (``local=True``: each machine's local rank 0), then the others,
        which find its cache (a ``datasets.map``, a download). Every rank enters it (main_first.py)."""
        return main_first(self.env, lambda name: self._monitor.phase(self._cycle.step, name), local)

    # --- per sample ---------------------------------------------------------------------------

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
        when each rank's share is one micro-batch; refused in one line under a smaller micro_batch
        and with ``bitwise=True`` (a backward a grain)."""
        if self._data_cfg.bitwise:
            raise ConfigError(
                "run.all_gather gathers the ranks' shares of a step, and bitwise=True runs a backward "
                "a grain that sees only its own samples; compute in-batch terms within the batch the "
                "loop is given (the grain, the same on every world size)"
            )
        self._cycle.first_step.note_gather()
        return all_gather(x, self._cycle.micro, self.env)

    # --- who and where this process is ---------------------------------------------------------

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
        """Samples per micro-batch on each rank (``micro_batch=``; with ``bitwise=True`` the grain),
        None: each rank's whole share of a step in one."""
        cfg = self._data_cfg
        if cfg.bitwise and self._train_loader is not None:
            return self._train_loader.global_batch // cfg.grains
        return cfg.micro_batch

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

    # --- the end -------------------------------------------------------------------------------

    def finish(self) -> None:
        """Finish the last step (its log line and checkpoint), write OUT/NAME.pt for every model on
        rank 0, draw OUT/loss.png, and leave the process group. All ranks call it. A run whose loop
        ended normally is finished at exit if the script does not call this itself."""
        if self._cycle.closed:
            return
        self._cycle.finish()
        if not self._cycle.closed:  # closed: a finished run that trained no step, left as it was
            save_final(self._models, self._objects, self.out, self.env)  # OUT/NAME.pt: models, then EMAs
        self.close(plot=True)

    def close(self, plot: bool = False) -> None:
        """Stop the diagnostics and leave the process group without another collective (after an error)."""
        atexit.unregister(self._finish_at_exit)
        self._cycle.close(plot)

    def _finish_at_exit(self) -> None:
        # Only after a loop that ended normally: a rank leaving through an exception must not enter
        # a collective its peers never reach (sys.last_value is set by the excepthook).
        if self._cycle.closed or getattr(sys, "last_value", None) is not None or not self._cycle.started:
            return self.close()
        log.info("finishing the run at exit (run.finish() was not called)")
        self.finish()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self.finish() if kind is None else self.close()
