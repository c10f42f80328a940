"""The parts one ``ddpkit.Run`` is built from, made in the order they depend on each other.

``Run.__init__`` calls ``build_parts`` once: the options split into each component's config, the
session (process group, OUT's lock, the checkpoint to resume), the monitor, the optimizer gate
on one ``StepState``, the per-sample draws and the step cycle that owns them. ``Run`` keeps the
result and delegates each call of the loop to one of its parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.logs import setup_logging
from ddpkit.run.config import (
    CheckpointConfig,
    DataConfig,
    DiagnosticsConfig,
    EngineConfig,
    OptimConfig,
    RunConfig,
    split_options,
)
from ddpkit.run.invariant import bitwise
from ddpkit.run.invariant.draws import SampleDraws
from ddpkit.run.invariant.seeding import seed_everything
from ddpkit.run.monitor.monitor import Monitor
from ddpkit.run.state import best
from ddpkit.run.state.session import Session
from ddpkit.run.step.cycle import StepCycle
from ddpkit.run.step.held_grads import HeldGrads
from ddpkit.run.step.optim import OptimizerGate
from ddpkit.run.step_state import StepState


@dataclass
class Parts:
    """What a Run holds: its configs, its session and the objects each call is delegated to.

    Attributes:
        cfg, data_cfg, engine_cfg, ckpt_cfg, optim_cfg, diag_cfg: the run's settings, by component.
        session: the process group, OUT's lock and the checkpoint to resume.
        monitor: timings, metrics lines, trackers and the hang watchdog's phases.
        draws: the per-sample keys of the loop's and the model's draws.
        cycle: the step cycle, the one owner of where the run is.
        scaler: fp16's GradScaler (disabled otherwise).
        models: name -> the wrapped model the user calls; objects: name -> what a checkpoint holds.
        best: run.save_best's value, checkpointed.
    """

    cfg: RunConfig
    data_cfg: DataConfig
    engine_cfg: EngineConfig
    ckpt_cfg: CheckpointConfig
    optim_cfg: OptimConfig
    diag_cfg: DiagnosticsConfig
    session: Session
    monitor: Monitor
    draws: SampleDraws
    cycle: StepCycle
    scaler: torch.amp.GradScaler
    models: dict[str, nn.Module]
    objects: dict[str, Any]
    best: best.BestKeeper


def build_parts(out: str | Path | None, seed: int, backend: str, steps: int | None, options: dict) -> Parts:
    """Validate the options, join the process group, seed python, numpy and torch with ``seed``,
    open OUT and make every part of a run.

    On an error after the session opened, it is left again (OUT's lock, the process group), so
    nothing is left behind."""
    data_cfg, engine_cfg, ckpt_cfg, optim_cfg, diag_cfg = split_options(options)
    cfg = RunConfig(str(out) if out is not None else None, seed, backend, steps)
    if out is None and ckpt_cfg.save_every:
        raise ConfigError(f"save_every={ckpt_cfg.save_every} needs out=FOLDER for its checkpoints")
    out = Path(out) if out is not None else None
    session = Session(backend, diag_cfg)
    setup_logging(session.env)
    seed_everything(seed)
    models: dict[str, nn.Module] = {}
    objects: dict[str, Any] = {best.NAME: best.BestKeeper()}
    scaler = torch.amp.GradScaler(session.env.device.type, enabled=engine_cfg.precision == "fp16")
    if scaler.is_enabled():  # its scale and growth tracker resume with the run
        objects["grad_scaler"] = scaler
    gate = OptimizerGate(optim_cfg, scaler, StepState(), HeldGrads(models))
    configs = (cfg, data_cfg, engine_cfg, ckpt_cfg, optim_cfg, diag_cfg)
    grains = None
    try:
        if data_cfg.bitwise:  # before anything is loaded: a world or engine that cannot is refused
            bitwise.check_world(
                data_cfg.grains, session.env.world_size, engine_cfg.engine, engine_cfg.compression
            )
            grains = bitwise.GrainSum(restore_kernels=bitwise.fix_kernels(session.env.device))
        session.open(out, ckpt_cfg, steps)
        params = {k: v for c in configs for k, v in dataclasses.asdict(c).items()}  # for trackers
        monitor = Monitor(session.env, diag_cfg, out, params)
    except BaseException:
        if grains is not None:
            grains.restore_kernels()
        session.leave()
        raise
    draws = SampleDraws(seed, session.env.device, eager=engine_cfg.invariant_dropout)
    cycle = StepCycle(session, monitor, gate, objects, models, out, ckpt_cfg, steps, draws, grains)
    return Parts(*configs, session, monitor, draws, cycle, scaler, models, objects, objects[best.NAME])
