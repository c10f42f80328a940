"""What rank 0 says after the run's first micro-batch: each habit seen that makes a step change
with the number of processes or micro_batch, once, with its fix.

The promise (docs/guarantees.md) is that a step is one process's update on the whole global
batch. A plain loop keeps it; a few habits of single-device scripts break it from the first
step, and are cheap to see while one micro-batch goes through the loop:

- dropout drawn from the process's generator: ``nn.Dropout`` modules and functional calls
  (``F.dropout``, attention's ``dropout_p``) the forward makes, named by module, when
  ``invariant_dropout`` is off (functional_dropout.py sees them; a module that is never called,
  as transformers' ``attn_dropout``, is not named);
- other draws from torch's global generator in the forward, which ``invariant_dropout`` does
  not key (``F.dropout2d``, ``torch.rand`` in a drop-path written by hand);
- draws from the global generators in the loop body, outside the model (numpy's or python's
  ``random``, or torch's: in-loop Mixup or noise), seen as a change of their state; not said
  when the body gathered the batch with ``run.all_gather`` (a Mixup over the whole global batch);
- BatchNorm in training mode, which normalises over each forward's samples;
- a loss that is plainly a sum over the batch (``reduction="sum"``, ``.sum()``) handed to
  ``run.backward`` as a mean (seen at the first backward from the loss's ``grad_fn``).

Under ``torch.compile`` the forward's calls are not seen (the loop body's draws still are).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from ddpkit.dist import DistEnv
from ddpkit.run.engine.wrap import unwrap
from ddpkit.run.invariant.draws import SampleDraws
from ddpkit.run.micro import Micro

log = logging.getLogger(__name__)

_DROPOUTS = ("F.dropout", "scaled_dot_product_attention")
_FIXES = (
    "draw per sample with run.rand_like/run.randn_like/run.randint, in the dataset's __getitem__ "
    "(seeded per sample), or over the gathered global batch (run.all_gather: docs/porting.md, Mixup)"
)


class FirstStep:
    """Watches the run's first micro-batch through the loop and reports what it saw (rank 0).

    Args:
        env: the rank (only rank 0 speaks).
        models: name -> the wrapped model (its BatchNorm modules are looked at).
        draws: the run's per-sample keys, holding each model's ``ForwardDraws``.
    """

    def __init__(self, env: DistEnv, models: dict[str, nn.Module], draws: SampleDraws) -> None:
        self.env, self.models, self.draws = env, models, draws
        self.done, self.gathered, self.loss_seen = False, False, False
        self._states: dict[str, Any] = {}

    def note_gather(self) -> None:
        """``run.all_gather`` was called: the loop's draws may be the whole global batch's."""
        self.gathered = True

    def check_loss(self, loss: torch.Tensor, reduction: str, count: object) -> None:
        """The first ``run.backward``: one line when the loss is plainly summed but weighed as a mean."""
        if self.loss_seen:
            return
        self.loss_seen = True
        if self.env.is_rank0 and reduction == "mean" and count is None and looks_summed(loss):
            say_summed_loss(type(loss.grad_fn).__name__)

    def before(self) -> None:
        """The first micro-batch is about to go to the loop: watch its forwards and generators."""
        if self.done:
            return
        for forward in self.draws.forwards:
            forward.observing = True
        self._states = global_states()

    def after(self, micro: Micro, global_batch: int) -> None:
        """The loop asked for the next micro-batch: say what the first one did, once."""
        if self.done:
            return
        self.done = True
        drawn = [name for name, state in global_states().items() if not _same(state, self._states[name])]
        seen = []
        for forward in self.draws.forwards:
            forward.done_observing()
            seen += [(forward.model_name, *s) for s in forward.seen]
        if self.env.is_rank0:
            self._report(seen, drawn, micro, global_batch)

    def _report(self, seen: list, drawn: list[str], micro: Micro, global_batch: int) -> None:
        dropped = [s for s in seen if not s[3] and s[1].startswith(_DROPOUTS)]
        other = [s for s in seen if not s[3] and not s[1].startswith(_DROPOUTS)]
        if dropped:
            say_dropout(dropped)
        if other:
            say_forward_draws(other)
        if dropped or other:  # the forward's own draws explain a change of torch's generator
            drawn = [name for name in drawn if name != "torch"]
        if drawn and not self.gathered:
            say_loop_draws(drawn)
        norms = batch_norms(self.models)
        if norms:
            say_batch_norm(norms, micro.samples, global_batch)


def global_states() -> dict[str, Any]:
    """The global generators' states: python's, numpy's legacy one, torch's CPU (and CUDA) one."""
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda"] = torch.cuda.get_rng_state()
    return states


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):  # numpy's: (name, keys array, pos, has_gauss, cached)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


def batch_norms(models: dict[str, nn.Module]) -> list[str]:
    """The BatchNorm modules in training mode (not SyncBatchNorm), by qualified name."""
    found = []
    for model in models.values():
        found += [
            name
            for name, m in unwrap(model).named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, nn.SyncBatchNorm)
            and m.training
        ]
    return found


def looks_summed(loss: torch.Tensor) -> bool:
    """The loss's last op sums over everything: ``.sum()``, or a torch loss with ``reduction="sum"``
    (its backward node keeps the reduction: 2 is sum)."""
    node = loss.grad_fn
    return node is not None and (
        type(node).__name__ == "SumBackward0" or getattr(node, "_saved_reduction", None) == 2
    )


def _some(names: list[str], n: int = 3) -> str:
    names = list(dict.fromkeys(names))
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def say_dropout(seen: list) -> None:
    """The forward drops out with the process's own generator (invariant_dropout is off)."""
    log.warning(
        "%s drops out in %s: each rank draws its masks from its own generator, so losses change "
        "with the number of processes and micro_batch; ddpkit.Run(invariant_dropout=True) draws "
        "them per sample instead (docs/guarantees.md)",
        seen[0][0],
        _some([f"{module} ({call})" for _, call, module, _ in seen]),
    )


def say_forward_draws(seen: list) -> None:
    """The forward draws from torch's global generator in calls nothing keys."""
    log.warning(
        "%s draws from torch's global generator in %s, which invariant_dropout does not key: those "
        "draws change with the number of processes and micro_batch; use nn.Dropout/nn.Dropout2d "
        "modules (keyed under invariant_dropout=True), or %s",
        seen[0][0],
        _some([f"{module} ({call})" for _, call, module, _ in seen]),
        _FIXES,
    )


def say_loop_draws(drawn: list[str]) -> None:
    """The loop body, outside the model, drew from a global generator (in-loop Mixup, noise)."""
    names = {"python": "python's random", "numpy": "numpy's np.random", "torch": "torch's"}
    log.warning(
        "the loop body drew from %s global generator outside the model in its first micro-batch: "
        "such draws (in-loop Mixup, noise, random crops of the batch) pair or perturb samples by "
        "the micro-batch each rank holds, which changes with the number of processes and "
        "micro_batch; %s",
        " and ".join(names.get(n, "torch's CUDA") for n in drawn),
        _FIXES,
    )


def say_batch_norm(names: list[str], samples: int, global_batch: int) -> None:
    """BatchNorm in training mode: its statistics are each forward's samples'."""
    log.warning(
        "BatchNorm in training mode in %s normalises over each forward's samples (%d here, of a "
        "global batch of %d), so its statistics and the step change with the number of processes "
        "and micro_batch; use ddpkit.Run(sync_batchnorm=True) on GPUs, GroupNorm or LayerNorm, or "
        "freeze the statistics (the BatchNorm modules in eval mode)",
        _some(names),
        samples,
        global_batch,
    )


def say_summed_loss(node: str) -> None:
    """``run.backward`` weighs its loss as a mean over samples; this one is a sum."""
    log.warning(
        "run.backward got a loss summed over the batch (its last op is %s): it is weighed as a mean "
        "over samples, so the update changes with the number of processes and micro_batch; pass "
        'run.backward(loss, reduction="sum"), or for a sum over tokens run.backward(loss, count=n)',
        node,
    )
