"""A world of one needs no engine: the model as it is, with the engine's face.

In a world of one there is nothing to all-reduce, yet torch's DDP still runs its reducer's hooks
and a one-process all-reduce every backward, which on a small MLP nearly doubles the step
(docs/engine.md, "Small costs behind the code's choices"). ``LocalEngine`` is what
``run.setup`` returns there instead: it calls the model directly, keeps the attributes the run
sets on an engine (``require_backward_grad_sync``, ``no_sync()``), and is unwrapped like one,
so checkpoints have the same keys either way. It keeps the engine's one-line errors for a loop
that would fail on several processes: ``requires_grad`` changed in the middle of a step, and a
backward pass that left trainable parameters without a gradient (as DDP does at the next
forward, unless ``find_unused_parameters``), watched over the first steps only (a hook per
parameter costs what the engine cost).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ddpkit.parallel.errors import DataParallelError
from ddpkit.parallel.sync import call_module, eager
from ddpkit.run.step_state import StepState

WATCHED_STEPS = 3  # steps whose backward passes are checked for parameters without a gradient


class LocalEngine(nn.Module):
    """The user's model in a world of one, behind the attributes of a data-parallel engine.

    Args:
        module: the model (on its device already).
        find_unused_parameters: a backward may leave parameters out (no check).
        state: the run's step state, read to stop the check after the first steps (None: the
            check never stops).
    """

    def __init__(
        self, module: nn.Module, find_unused_parameters: bool = False, state: StepState | None = None
    ) -> None:
        super().__init__()
        self.module = module
        self._steps = state
        # What an engine reads before a forward or backward: nothing to sync here.
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._got: set[int] = set()  # parameters given a gradient since the last forward
        self._armed = False  # the last forward expects every trainable parameter to get one
        self._hooks: list = []
        self._watching = not find_unused_parameters
        self.replan()

    def forward(self, *inputs, **kwargs):
        if self._watching:
            self._check_last_backward()
        return call_module(self.module, *inputs, **kwargs)

    @eager
    def _check_last_backward(self) -> None:
        # As DDP's reducer at the next forward: some gradients came, but not all of them.
        if self._armed and self._got:
            missing = [name for name, p in numbered(self.module) if id(p) not in self._got]
            if missing:
                error = DataParallelError(f"{len(missing)} parameters got no gradient")
                error.missing = missing
                raise error
        self._got.clear()
        self._armed = torch.is_grad_enabled()
        if self._steps is not None and self._steps.step > WATCHED_STEPS:
            self._watching = False
            self.replan()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's: backward passes inside accumulate locally (here, as always)."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def replan(self) -> None:
        """A change of ``requires_grad`` needs no new buckets (there are none), only the watch's
        hooks on what is trainable now."""
        for hook in self._hooks:
            hook.remove()
        self._got.clear()
        got = self._got  # not self: torch cannot collect a cycle through a post-accumulate-grad
        # hook (a hook that reached the engine, and so the model, would keep both alive for good)
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda param: got.add(id(param)))
            for p in self.module.parameters()
            if p.requires_grad and self._watching
        ]


def numbered(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters in torch DDP's order (``_build_params_for_reducer``): each module's
    own, in ``named_modules`` order, each parameter once."""
    seen, found = set(), []
    for prefix, child in module.named_modules():
        for name, param in child.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                found.append((f"{prefix}.{name}".lstrip("."), param))
    return found
