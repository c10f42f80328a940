"""Every frozen config of a ``ddpkit.Run``, and the routing of its keyword options to them.

A leaf: it imports nothing of the runtime, so ``ddpkit train`` builds and checks a ``JobConfig``
from these classes without the front door. Each class's docstring is the reference of its
options (``ddpkit train`` generates its flags from them, ``train/flags.py``).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, fields
from typing import Any

from ddpkit.choices import BACKENDS
from ddpkit.errors import ConfigError
from ddpkit.run.engine.config import EngineConfig

NONFINITE = ("stop", "skip")
TRACKERS = ("tensorboard", "mlflow", "wandb")


@dataclass(frozen=True)
class RunConfig:
    """Which run this is: where it writes, how it is seeded, how far it goes.

    Args:
        out: folder for checkpoints, metrics.jsonl, loss.png, model.pt and hang reports; None
            writes nothing (and allows no checkpoints).
        seed: seeds every generator, the same on every rank, and the data order.
        backend: ``auto`` (nccl with a GPU per process, else gloo), ``gloo``, ``nccl`` or ``mpi``.
        steps: stop after this many optimizer steps; None runs the epochs the loop asks for.
    """

    out: str | None = None
    seed: int = 0
    backend: str = "auto"
    steps: int | None = None

    def __post_init__(self) -> None:
        if self.out is not None and not str(self.out).strip():
            raise ConfigError("out='' names no folder; give one such as 'runs/mine', or None for no files")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be a non-negative integer")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.steps is not None and (isinstance(self.steps, bool) or self.steps < 1):
            raise ConfigError(f"steps={self.steps} is below 1; use a positive number, or None for epochs")


@dataclass(frozen=True)
class DataConfig:
    """How the training data is cut into steps.

    Args:
        global_batch: samples per optimizer step over all ranks (None: the batch_size of the
            DataLoader given to ``run.loader``); must split evenly over the ranks.
        micro_batch: samples per forward/backward on one rank; below the rank's share of the
            global batch it means gradient accumulation. None: the whole share at once.
        drop_last: skip each epoch's final partial global batch. None: the drop_last of the
            DataLoader given to ``run.loader``, else False (the last partial batch is used).
        shuffle: a new order each epoch, drawn from (seed, epoch) alone. None: the shuffle of the
            DataLoader given to ``run.loader``, else True (a dataset given bare is shuffled).
        bitwise: the same losses and weights to the bit on 1, 2, 4 ... ``grains`` processes: the
            global batch is cut into ``grains`` fixed grains, one backward each, their gradients
            added in one binary tree on every world size (run/invariant/bitwise.py; engines torch
            and native, map-style datasets, full global batches).
        grains: the grains of a bitwise run's global batch, a power of two at least the largest
            world size it will run on; checkpointed with the run.
    """

    global_batch: int | None = None
    micro_batch: int | None = None
    drop_last: bool | None = None
    shuffle: bool | None = None
    bitwise: bool = False
    grains: int = 8

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r} must be a positive integer (or None)")
        for name in ("drop_last", "shuffle"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be True, False or None (the DataLoader's)")
        if not isinstance(self.bitwise, bool):
            raise ConfigError(f"bitwise={self.bitwise!r} must be True or False")
        grains = self.grains
        if isinstance(grains, bool) or not isinstance(grains, int) or grains < 1 or grains & (grains - 1):
            raise ConfigError(f"grains={grains!r} must be a power of two (1, 2, 4, 8, 16 ...)")


@dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are written and whether a run continues from one.

    Args:
        save_every: write a checkpoint every this many optimizer steps and at ``run.finish()``;
            0 writes none.
        keep_last: how many checkpoints to keep, newest first.
        resume: ``auto`` (the newest good checkpoint in OUT/checkpoints, if any), ``never``
            (start fresh; refused if OUT already holds a run) or the path of a checkpoint.
        preempt_signals: signals that make every rank finish its step, checkpoint it (also when
            save_every is 0) and exit with 128 + the signal's number, e.g. ``"TERM,INT,USR1"`` for
            SLURM's ``--signal=USR1@90``; a second signal exits at once. ``""`` leaves them alone.
        async_save: the step waits only for a copy of the state in host memory, and a thread
            writes it (checkpoint/background.py): rank 0's state.pt, and with sharded saves
            (fsdp, sharded_save) every rank's shards through DCP's async_save (checkpoint/dcp.py).
        sharded_save: the torch and native engines save models and optimizers through DCP, each
            rank writing about 1/N of them; None: from 256 MiB of them on 2+ ranks (fsdp always),
            unless async_save.
    """

    save_every: int = 0
    keep_last: int = 2
    resume: str = "auto"
    preempt_signals: str = "TERM,INT"
    async_save: bool = False
    sharded_save: bool | None = None

    def __post_init__(self) -> None:
        if self.save_every < 0:
            raise ConfigError(f"save_every={self.save_every} is below 0; use 0 to write no checkpoints")
        if self.keep_last < 1:
            raise ConfigError(f"keep_last={self.keep_last} is below 1; keep at least one checkpoint")
        if not self.resume:
            raise ConfigError("resume='' names nothing; use 'auto', 'never' or a checkpoint path")
        for name in filter(None, self.preempt_signals.split(",")):
            if not hasattr(signal, f"SIG{name.strip()}"):
                raise ConfigError(
                    f"preempt_signals: unknown signal {name!r}; use names such as TERM,INT,USR1"
                )


@dataclass(frozen=True)
class OptimConfig:
    """What happens in the optimizer step that ddpkit sees.

    Args:
        grad_clip: clip each optimizer's gradient norm to this; 0 disables clipping.
        on_nonfinite: a non-finite gradient norm ``stop``s the run on every rank, or ``skip``s
            that optimizer step (its gradients are dropped).
        allow_unstepped: a step whose loop ran a backward but stepped no tracked optimizer is
            an error by default (a loop's own gradient accumulation, which a checkpoint would cut
            in half: set micro_batch instead); True for a loop that skips steps on purpose.
    """

    grad_clip: float = 0.0
    on_nonfinite: str = "stop"
    allow_unstepped: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.grad_clip < float("inf"):
            raise ConfigError(f"grad_clip={self.grad_clip} must be finite and >= 0; use 0 to disable, or 1.0")
        if self.on_nonfinite not in NONFINITE:
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r} must be 'stop' or 'skip'")


@dataclass(frozen=True)
class DiagnosticsConfig:
    """What a Run watches and reports while the user's loop trains.

    Args:
        log_every: gather the loss, timings and user metrics and write a metrics line every
            this many steps (and at step 1 and at the end). None (the default): every 10 steps,
            or, when steps are short, every 20, 50, ... 1000 steps, the first that lasts 0.1 s
            by the slowest rank's median step (``paced_every``); pass a number for lines at
            fixed steps.
        check_every: every this many steps, all ranks compare parameter fingerprints; 0 disables.
            None (the default): every 100 steps, or 200, 500, ... 10000, the first that lasts 1 s.
        rank_table_every: rank 0 logs every rank's data / compute / comm-wait seconds this often;
            0 disables (stragglers are warned about regardless).
        collective_timeout: seconds a rank may spend without progress in a collective before the
            watchdog names the ranks that are behind, prints every rank's stack and ends the run;
            0 disables. Generous by default: a slow rank is not a hung one.
        desync_timeout: seconds every rank may wait inside a collective while the ranks wait in
            different ones (a collective only some ranks called, such as a run.save() under
            ``if run.is_main``) before the watchdog reports the desync and ends the run; a slow
            rank that is not inside a collective is never taken for one. 0 disables.
        startup_timeout: seconds every rank may take to join the process group (a node still
            pulling its container, a slow import) before start-up fails, and, when longer than
            the collective timeout, the hang watchdog's limit until the loop's first step has
            ended (DDP's constructor, a checkpoint load, the data workers' start: as slow as the
            machine's load makes them); after that the collective timeout applies.
        progress: show a progress bar on rank 0.
        log_samples: each rank appends the dataset indices of each step to OUT/samples/rank{R}.jsonl.
        trackers: experiment trackers rank 0 sends every metrics line to, any of ``tensorboard``,
            ``mlflow`` and ``wandb`` (a list is taken; each needs its extra, such as
            ``pip install "ddpkit[mlflow]"``); a resumed run continues their runs. See docs/trackers.md.
        flops_per_sample: the model's FLOPs for one sample's forward and backward (a transformer:
            about 6 x parameters x tokens a sample); with a device peak, log lines carry ``mfu``.
        peak_flops: one device's peak FLOP/s for ``mfu``; None: a GPU's dense bf16 peak from
            ddpkit's table of common GPUs (none on a CPU or an unlisted GPU: no ``mfu``).
    """

    log_every: int | None = None
    check_every: int | None = None
    rank_table_every: int = 0
    collective_timeout: float = 1800.0
    desync_timeout: float = 30.0
    startup_timeout: float = 600.0
    progress: bool = True
    log_samples: bool = False
    trackers: tuple[str, ...] = ()
    flops_per_sample: float | None = None
    peak_flops: float | None = None

    def __post_init__(self) -> None:
        for name in ("flops_per_sample", "peak_flops"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive number of FLOPs, or None")
        if not isinstance(self.trackers, list | tuple):
            raise ConfigError(f"trackers={self.trackers!r} must be a list of names, such as ['tensorboard']")
        object.__setattr__(self, "trackers", tuple(dict.fromkeys(self.trackers)))  # frozen: set once here
        for name in self.trackers:
            if name not in TRACKERS:
                raise ConfigError(f"unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        if self.log_every is not None and self.log_every < 1:
            raise ConfigError(f"log_every={self.log_every} is below 1; use a positive number of steps")
        if not 0 < self.startup_timeout < float("inf"):
            raise ConfigError(f"startup_timeout={self.startup_timeout} must be a positive number of seconds")
        for name in ("check_every", "rank_table_every", "collective_timeout", "desync_timeout"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise ConfigError(f"{name}={getattr(self, name)} is below 0; use 0 to disable")


COMPONENTS = (DataConfig, EngineConfig, CheckpointConfig, OptimConfig, DiagnosticsConfig)


def split_options(options: dict[str, Any]) -> tuple:
    """One config per component, in ``COMPONENTS`` order; an unknown option is an error naming it."""
    owners = {f.name: cls for cls in COMPONENTS for f in fields(cls)}
    unknown = sorted(set(options) - set(owners))
    if unknown:
        raise ConfigError(f"ddpkit.Run got unknown options {unknown}; known ones are {sorted(owners)}")
    configs = tuple(cls(**{k: v for k, v in options.items() if owners[k] is cls}) for cls in COMPONENTS)
    return configs


def check_split(global_batch: int, world_size: int) -> None:
    """Fail unless ``global_batch`` splits evenly over ``world_size`` ranks, naming the sizes that work."""
    if global_batch % world_size == 0:
        return
    works = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    raise ConfigError(
        f"global_batch={global_batch} cannot be split evenly across {world_size} processes; "
        f"use a global batch that is a multiple of {world_size}, or a world size in {works}"
    )


def check_same_global_batch(saved: int, current: int) -> None:
    """A position saved with another global batch means other steps: refused in one line."""
    if saved != current:
        raise ConfigError(
            f"the checkpoint was made with global_batch={saved}, this run has {current}; "
            "resume with the same global batch, or start another out"
        )
