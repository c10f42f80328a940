"""The built-in Trainer: the DDP tutorials' Trainer shape (``_run_batch``, ``_run_epoch``) on ``ddpkit.Run``.

Everything distributed is the Run's: the process group, the engine, the global-batch loader,
gradient accumulation and loss scaling, checkpoints and exact resume, the diagnostics. The
Trainer only says what one batch is: a forward, a loss, ``run.backward``, the optimizer and the
scheduler, which are the task's own (or AdamW and warmup-cosine when the task brings none).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.run import Run
from ddpkit.run.engine.fsdp import is_sharded
from ddpkit.run.engine.wrap import unwrap
from ddpkit.run.monitor.metrics import read_metrics
from ddpkit.train.config import TrainConfig
from ddpkit.train.job import task_name
from ddpkit.train.schedule import warmup_cosine_schedule
from ddpkit.train.task import Task

log = logging.getLogger(__name__)


def make_optimizer(
    params: Iterable[nn.Parameter] | nn.Module, lr: float, weight_decay: float = 0.1
) -> torch.optim.Optimizer:
    """AdamW that decays matrices only: biases and norm gains are not pulled towards zero."""
    if isinstance(params, nn.Module):
        params = params.parameters()
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


class Trainer:
    """Trains ``task`` on every rank of ``run``.

    Args:
        run: the process's ddpkit.Run, which holds the steps, batch sizes, engine and checkpoints.
        task: the model, data, loss and (optionally) optimizer and scheduler factories.
        cfg: epochs, the default optimizer's settings, evaluation and DataLoader workers.
    """

    def __init__(self, run: Run, task: Task, cfg: TrainConfig) -> None:
        if len(task.dataset) == 0:
            raise ConfigError(f"the task {cfg.task!r} has an empty dataset; give it samples to train on")
        self.run, self.task, self.cfg = run, task, cfg
        self.model = run.setup(task.model)
        extra = {"collate_fn": task.collate_fn} if task.collate_fn is not None else {}
        if cfg.num_workers > 0:  # workers live across epochs instead of starting again at each
            extra["persistent_workers"] = True
        self.loader = run.loader(task.dataset, num_workers=cfg.num_workers, **extra)
        self.total_steps = run.steps or (cfg.epochs or 1) * self.loader.steps_per_epoch
        if task.optimizer is not None:
            self.optimizer = task.optimizer(self.model.parameters())
        else:
            self.optimizer = make_optimizer(self.model.parameters(), cfg.lr, cfg.weight_decay)
        if task.scheduler is not None:
            self.scheduler = task.scheduler(self.optimizer)
        else:
            self.scheduler = warmup_cosine_schedule(self.optimizer, cfg.warmup_steps, self.total_steps)
        run.track(optimizer=self.optimizer, scheduler=self.scheduler)

    def fit(self) -> None:
        """Train to the last step (from where a resumed run stopped), then finish the run."""
        try:
            while self.run.step < self.total_steps:
                self._run_epoch(self.loader.epoch)
        except BaseException:
            self.run.close()  # no collective after a failure: the other ranks may never reach it
            raise
        self.run.finish()
        if self.run.env.is_rank0:
            self._summary()

    def _run_epoch(self, epoch: int) -> None:
        for batch in self.loader:
            self._run_batch(batch)
            if self.run.at_step_end and self._eval_due():
                self.evaluate()

    def fit_batch(self, batch: Any) -> None:
        """One batch of ``fit``, for a caller that drives the loader itself (``ddpkit bench
        trainer``): ``_run_batch``, with a subclass's override."""
        self._run_batch(batch)

    def _run_batch(self, batch: Any) -> None:
        loss = self.loss(batch)
        self.optimizer.zero_grad()
        self.run.backward(loss)
        self.optimizer.step()
        self.scheduler.step()

    def loss(self, batch: Any) -> torch.Tensor:
        """The mean loss over ``batch``: the task's loss_fn, or the loss the model returns."""
        if self.task.loss_fn is None:
            return loss_of(_call(self.model, batch))
        if isinstance(batch, tuple | list):
            return self.task.loss_fn(_call(self.model, batch[:-1]), batch[-1])
        return self.task.loss_fn(_call(self.model, batch), batch)

    def _eval_due(self) -> bool:
        every, step = self.cfg.eval_every, self.run.step
        due = every > 0 and (step % every == 0 or step == self.total_steps)
        return due and self.task.eval_dataset is not None

    def evaluate(self) -> dict[str, float]:
        """Mean loss over the whole held-out split, each sample once; logged with the step."""
        share = self.run.micro_batch or self.loader.global_batch // self.run.env.world_size
        extra = {"collate_fn": self.task.collate_fn} if self.task.collate_fn is not None else {}
        result = self.run.evaluate(self.task.eval_dataset, self.loss, batch_size=share, **extra)
        self.run.log(eval_loss=result["value"], eval_samples=result["samples"])
        if self.run.env.is_rank0:
            log.info("step %d: eval loss %.4f", self.run.step, result["value"])
        return result

    def _summary(self) -> None:
        out = self.run.out
        if out is None or not (out / "metrics.jsonl").is_file():
            return
        logged = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        if logged:  # from the whole file: a resumed run's summary covers the run, not the resumed part
            env = self.run.env
            print(
                f"ddpkit: {task_name(self.cfg.task)} trained to step {logged[-1]['step']} on "
                f"{env.world_size} processes ({env.backend}); loss {logged[0]['loss']:.3f} -> "
                f"{logged[-1]['loss']:.3f}; wrote {out / 'model.pt'}",
                flush=True,
            )
        # A sharded model cannot run here: its shards' process group is closed (sample OUT/model.pt).
        model = unwrap(self.model)
        text = self.task.finish(model) if self.task.finish and not is_sharded(model) else None
        if text is not None:
            print(f"--- sample ---\n{text}\n--------------", flush=True)
            (out / "sample.txt").write_text(text, encoding="utf-8")


def _call(model: nn.Module, inputs: Any) -> Any:
    """model(**dict), model(*tuple) or model(tensor)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


def loss_of(output: Any) -> torch.Tensor:
    """The loss a model returned: a tensor, ``output["loss"]`` or ``output.loss``."""
    if isinstance(output, torch.Tensor):
        loss = output
    else:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        if isinstance(output, torch.Tensor):
            output = f"a tensor of shape {tuple(output.shape)}"
        raise ConfigError(
            f"the task has no loss_fn, so the model must return its loss (a tensor, a dict with "
            f"'loss' or an object with .loss); it returned {_what(output)}: give the Task a loss_fn"
        )
    return loss


def _what(output: Any) -> str:
    return output if isinstance(output, str) else type(output).__name__
