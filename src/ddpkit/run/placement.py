"""``run.setup``'s work on a model: checked, given its values, wrapped in the engine, resumed.

In order: every rank's build is the same (shapes and values); dropout modules are keyed per
sample when asked, and the forward's functional draws keyed or watched (functional_dropout.py);
a model built on meta gets its values (materialize.py), an eager one the checkpoint's weights
when the run resumes; the comm-wait clock watches it (2+ ranks), the engine wraps it,
and a sharded checkpoint's weights load into the shards.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from ddpkit.dist import DistEnv
from ddpkit.run.engine.config import EngineConfig
from ddpkit.run.engine.materialize import WeightsPlan
from ddpkit.run.engine.models import check_same_model, load_weights
from ddpkit.run.engine.wrap import unwrap, wrap
from ddpkit.run.invariant.draws import SampleDraws
from ddpkit.run.invariant.dropout import key_dropout
from ddpkit.run.invariant.functional_dropout import ForwardDraws
from ddpkit.run.monitor.monitor import Monitor
from ddpkit.run.state.dcp_state import load_model
from ddpkit.run.state.session import Session
from ddpkit.run.step_state import StepState


def place_model(
    model: nn.Module,
    name: str,
    session: Session,
    env: DistEnv,
    cfg: EngineConfig,
    draws: SampleDraws,
    monitor: Monitor,
    state: StepState,
    weights: str | Path | None,
    init: Callable[[nn.Module], object] | None,
) -> nn.Module:
    """The wrapped model ``run.setup`` returns, registered as ``name`` (its part of the checkpoint
    the session resumes from, if any, is its weights)."""
    saved, resume_path = session.saved_state(name), session.resume_path
    plan = WeightsPlan(model, env.device, cfg, saved, weights, init)
    check_same_model(model, env)
    if cfg.invariant_dropout:
        key_dropout(model, draws, cfg.dropout_batch_dim)
    # Functional dropout keyed, and the first step's draws seen (first_step.py says which break it).
    draws.forwards.append(ForwardDraws(model, draws, cfg.dropout_batch_dim, cfg.invariant_dropout))
    plan.before_wrap(unwrap(model), lambda m: load_weights(m, saved, name, resume_path))
    if env.world_size > 1:  # before the engine's hooks, which wait for the all-reduce
        monitor.watch(model)
    wrapped = wrap(model, env, cfg, draws, state)
    plan.after_wrap(unwrap(wrapped))
    load_model(resume_path, name, saved, unwrap(wrapped), session.kept)  # a sharded checkpoint's
    return wrapped
