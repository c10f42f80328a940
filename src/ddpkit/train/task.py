"""``ddpkit.Task``: a user's model, data and loss, handed to ``ddpkit train`` by a file or a module.

``ddpkit train path/to/task.py`` (or ``package.module:build``) imports the file in every worker
and calls ``build(cfg)`` with the run's config (``cfg.train.lr``, ``cfg.run.seed``, ...), after
ddpkit has seeded every generator alike, so every rank builds the same model.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit.errors import ConfigError


@dataclass
class Task:
    """What ``ddpkit train`` trains.

    Args:
        model: the model, built the same on every rank.
        dataset: map-style training dataset; its items may be tensors, tuples or dicts.
        loss_fn: ``loss_fn(output, target)`` -> mean loss over the batch, where target is a tuple
            batch's last element (the rest are the model's inputs) or the whole batch otherwise.
            None: the model returns its loss, as a tensor, a dict with "loss" or an object with
            ``.loss`` (HuggingFace models given labels).
        eval_dataset: held-out data, evaluated exactly (every sample once) every --eval-every steps.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``; None: AdamW with --lr and
            --weight-decay (matrices decayed, biases and norms not).
        scheduler: ``scheduler(optimizer) -> LR scheduler`` stepped once per optimizer step; None:
            linear warmup for --warmup-steps, then cosine decay to a tenth of --lr.
        collate_fn: as for torch's DataLoader (padding variable-length samples, say).
        finish: called on rank 0 with the trained model; returns text to print (a sample) or None.
    """

    model: nn.Module
    dataset: Dataset
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    eval_dataset: Dataset | None = None
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    collate_fn: Callable[[list], Any] | None = None
    finish: Callable[[nn.Module], str | None] | None = None


def is_task_spec(name: str) -> bool:
    """A file (``path/task.py``) or a module function (``package.module:build``), not a workload name."""
    return name.endswith(".py") or ":" in name or "/" in name


def check_task_spec(spec: str) -> str:
    """The spec as every worker should see it: an existing file becomes an absolute path."""
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(
                f"task file {spec!r} does not exist; give a Python file that defines build(cfg) "
                "returning ddpkit.Task, or a built-in workload name"
            )
        return str(path.resolve())
    return spec


def build_task(spec: str, cfg: Any) -> Task:
    """Import ``spec`` and call its build function with ``cfg``; a one-line error if it is not a task."""
    build, where = _find_build(spec)
    task = build(cfg)
    if not isinstance(task, Task):
        raise ConfigError(
            f"{where} returned {type(task).__name__}, not ddpkit.Task; return "
            "ddpkit.Task(model=..., dataset=..., loss_fn=...)"
        )
    if not isinstance(task.model, nn.Module):
        raise ConfigError(f"{where}: Task.model is {type(task.model).__name__}, not a torch.nn.Module")
    return task


def _find_build(spec: str) -> tuple[Callable[[Any], Any], str]:
    if spec.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(f"ddpkit_task_{Path(spec).stem}", spec)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        name, where = "build", f"{spec}: build(cfg)"
    else:
        module_name, _, name = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise ConfigError(f"task {spec!r}: cannot import {module_name!r} ({exc})") from None
        name = name or "build"
        where = f"{module_name}:{name}(cfg)"
    build = getattr(module, name, None)
    if not callable(build):
        raise ConfigError(
            f"{spec} does not define {name}(cfg); define {name}(cfg) returning "
            "ddpkit.Task(model=..., dataset=..., loss_fn=...)"
        )
    return build, where
