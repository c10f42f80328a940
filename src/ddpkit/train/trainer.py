"""The Trainer: global-batch steps, gradient accumulation, mixed precision, logging, exact resume.

One step is one global batch of ``cfg.global_batch`` samples whatever the world size: each rank
takes its slice (GlobalBatchSampler), splits it into micro-batches, accumulates gradients under
``no_sync`` and reduces once. Each rank's loss is a sum over its samples divided by the global
sample count (times world_size, because the engine averages over ranks), so one step is the same
update on 1 process or on 64.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.diagnostics import HangWatchdog, check_replicas_agree, check_same_config
from ddpkit.dist import DistEnv
from ddpkit.errors import ConfigError
from ddpkit.parallel import DataParallel
from ddpkit.train import checkpointing
from ddpkit.train.batches import collate, micro_batches
from ddpkit.train.callbacks import Callback, MetricsFile, ProgressBar, SampleLog
from ddpkit.train.config import TrainConfig, check_split
from ddpkit.train.schedule import warmup_cosine
from ddpkit.train.stats import StepClock, Window, rank_table, stragglers

log = logging.getLogger(__name__)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW that decays matrices only: biases and norm gains are not pulled towards zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def wrap_model(model: nn.Module, env: DistEnv, engine: str) -> nn.Module:
    """Wrap the local replica in the gradient-synchronization engine (rank 0's weights are broadcast)."""
    if engine == "native":
        return DataParallel(model)
    device_ids = [env.local_rank] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


class Trainer:
    """Trains a model data-parallel on every rank of ``env``.

    Args:
        model: the bare model (on any device; moved to ``env.device``).
        dataset: map-style dataset of (input, target) pairs.
        loss_fn: ``loss_fn(output, target)`` -> mean loss over the batch.
        env: this process's distributed environment.
        cfg: steps, batch sizes, schedule, precision, checkpointing and logging settings.
        optimizer: defaults to AdamW over the wrapped model's parameters.
        eval_dataset: held-out (input, target) pairs, evaluated exactly over the whole split.
        callbacks: extra callbacks, run after the built-in progress bar and metrics file.
    """

    def __init__(
        self,
        model: nn.Module,
        dataset: Dataset,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        env: DistEnv,
        cfg: TrainConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        eval_dataset: Dataset | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        check_split(cfg.global_batch, env.world_size)
        if cfg.precision == "fp16" and env.device.type != "cuda":
            raise ConfigError(
                "--precision fp16 needs a GPU (it scales the loss with a GradScaler); "
                "use --precision bf16 on CPU"
            )
        self.env, self.cfg, self.loss_fn = env, cfg, loss_fn
        self.dataset, self.eval_dataset = dataset, eval_dataset
        self.model = wrap_model(model.to(env.device), env, cfg.engine)
        self.optimizer = optimizer or make_optimizer(self.model.module, cfg.lr, cfg.weight_decay)
        self.sampler = GlobalBatchSampler(
            len(dataset), cfg.global_batch, env.rank, env.world_size, seed=cfg.seed, drop_last=cfg.drop_last
        )
        self.total_steps = cfg.steps if cfg.epochs is None else cfg.epochs * self.sampler.steps_per_epoch
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.precision == "fp16")
        self.out = Path(cfg.out)
        self.step = 0
        self.records: list[dict] = []
        self.clock = StepClock(self.model.module)
        self.skipped_steps = 0
        self.watchdog: HangWatchdog | _NoWatchdog = _NoWatchdog()
        self.callbacks = [
            ProgressBar(),
            MetricsFile(),
            *([SampleLog()] if cfg.log_samples else []),
            *callbacks,
        ]

    def fit(self) -> list[dict]:
        """Run to ``total_steps`` (resuming first if asked); returns the logged records."""
        with self._watchdog() as watchdog:
            self.watchdog = watchdog
            watchdog.phase(self.step, "start-up: config check all_gather_object")
            # Where a node writes (--out) and how it starts (--resume) may differ between nodes.
            check_same_config(self.cfg.replace(out="", resume="").to_json(), self.env)
            watchdog.phase(self.step, "resume: checkpoint choice broadcast and replica check")
            checkpointing.maybe_resume(self)
            self._emit("on_fit_start")
            window = Window(self.env.device, self.clock)
            while self.step < self.total_steps:
                self.step += 1
                watchdog.phase(self.step, "forward/backward: gradient all-reduce")
                indices, loss_sum = self._run_step()
                window.add(loss_sum, len(indices))
                self._emit("on_step_end", self.step, indices)
                self._after_step(window)
            self._emit("on_fit_end")
        return self.records

    def _watchdog(self) -> contextlib.AbstractContextManager:
        if not self.cfg.collective_timeout:
            return contextlib.nullcontext(_NoWatchdog())
        report = self.out / "hang-report.txt"
        return HangWatchdog(self.env, self.cfg.collective_timeout, report_path=report)

    def _after_step(self, window: Window) -> None:
        last, phase = self.step == self.total_steps, self.watchdog.phase
        evals = {}
        if self._due(self.cfg.eval_every, last) and self.eval_dataset is not None:
            phase(self.step, "eval: loss all_reduce")
            evals = self.evaluate()
        # Step 1 too: the loss before training has moved anything is the reference point.
        if self.step % self.cfg.log_every == 0 or self.step == 1 or last or evals:
            phase(self.step, "log: loss and timings all_gather")
            self._emit("on_log", self._log(window, evals))
            window.reset()
        if self._due(self.cfg.check_every, last):
            phase(self.step, "check: replica fingerprint all_gather")
            check_replicas_agree(self.model.module, self.env, f"at step {self.step}", buffers=False)
        if self._due(self.cfg.save_every, last):
            phase(self.step, "checkpoint: RNG states all_gather_object")
            checkpointing.save(self)

    def _due(self, every: int, last: bool) -> bool:
        return every > 0 and (self.step % every == 0 or last)

    def _run_step(self) -> tuple[list[int], Tensor]:
        lr = warmup_cosine(self.step, self.cfg.lr, self.cfg.warmup_steps, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.sampler.next_global_batch()
        mine = self.sampler.rank_slice(batch)
        # A rank left without samples (an epoch's last, partial batch) still joins the gradient
        # all-reduce, with one sample at weight 0, or the other ranks would wait for it forever.
        chunks, weight = (micro_batches(mine, self.cfg.micro_batch), 1.0) if mine else ([batch[:1]], 0.0)
        scale = weight * self.env.world_size / len(batch)
        self.optimizer.zero_grad(set_to_none=True)
        sums = []
        for i, chunk in enumerate(chunks):
            # no_sync on all but the last micro-batch: gradients accumulate locally, reduced once.
            sync = contextlib.nullcontext() if i == len(chunks) - 1 else self.model.no_sync()
            with sync:
                sums.append(self._run_micro(chunk, scale))
        self._optimizer_step()
        loss_sum = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
        return mine, loss_sum if mine else loss_sum * 0

    def _run_micro(self, chunk: list[int], scale: float) -> Tensor:
        start = time.perf_counter()
        x, y = collate(self.dataset, chunk, self.env.device)
        fetched = time.perf_counter()
        with self._autocast():
            loss = self.loss_fn(self.model(x), y).float()  # mean over the chunk
        backward_start = time.perf_counter()
        # chunk mean * len(chunk) = the chunk's sum; * scale = its share of the global mean.
        self.scaler.scale(loss * (len(chunk) * scale)).backward()
        self.clock.add("data_s", fetched - start)
        self.clock.add("compute_s", backward_start - fetched)
        self.clock.backward_done(backward_start)
        return loss.detach() * len(chunk)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()  # cheaper than a disabled autocast, once per micro-batch
        dtype = torch.float16 if self.cfg.precision == "fp16" else torch.bfloat16
        return torch.autocast(self.env.device.type, dtype=dtype)

    def _optimizer_step(self) -> None:
        start = time.perf_counter()
        self.scaler.unscale_(self.optimizer)  # clip and check the true gradient, not the fp16-scaled one
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = nn.utils.clip_grad_norm_(params, max_norm)
        # The norm is of the all-reduced gradient, identical on every rank, so every rank takes
        # the same decision here without another collective: no rank goes on alone.
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)  # the GradScaler skips non-finite steps itself
            self.scaler.update()
        elif torch.isfinite(norm):
            self.optimizer.step()
        else:
            self._non_finite(norm)
        self.clock.add("compute_s", time.perf_counter() - start)

    def _non_finite(self, norm: Tensor) -> None:
        if self.cfg.on_nonfinite == "stop":
            raise FloatingPointError(
                f"step {self.step}: the gradient norm is {norm.item()} on every rank; lower --lr or "
                "check the data, or pass --on-nonfinite skip to skip such steps"
            )
        self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.env.is_rank0:
            log.warning(
                "step %d: gradient norm is %s; step skipped (--on-nonfinite skip)", self.step, norm.item()
            )

    def _log(self, window: Window, extra: dict) -> dict:
        # Every rank logs at the same steps, so this all_gather is matched on all of them.
        loss, samples, ranks = window.gather(self.env)
        elapsed = time.perf_counter() - window.start
        record = {
            "step": self.step,
            "loss": loss,
            "samples_per_s": samples / elapsed,
            "lr": self.optimizer.param_groups[0]["lr"],
            "time_s": elapsed,
            **{k: round(v, 6) for k, v in self.clock.totals.items()},
            "skipped_steps": self.skipped_steps,
            "ranks": ranks,
            **extra,
        }
        self.records.append(record)
        if self.env.is_rank0:
            self._report_ranks(ranks)
        return record

    def _report_ranks(self, ranks: list[dict]) -> None:
        if self.cfg.rank_table_every and self.step % self.cfg.rank_table_every == 0:
            log.info("%s", rank_table(self.step, ranks))
        for rank, factor in stragglers(ranks):
            log.warning(
                "step %d: rank %d is a straggler: its data + compute took %.1fx the other ranks' median",
                self.step,
                rank,
                factor,
            )

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss over the whole held-out split: each sample counted once, no padding."""
        module = self.model.module
        module.eval()
        mine = list(range(self.env.rank, len(self.eval_dataset), self.env.world_size))
        totals = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        for chunk in micro_batches(
            mine, self.cfg.micro_batch or self.cfg.global_batch // self.env.world_size
        ):
            x, y = collate(self.eval_dataset, chunk, self.env.device)
            totals[0] += self.loss_fn(module(x), y).double() * len(chunk)
            totals[1] += len(chunk)
        dist.all_reduce(totals)
        module.train()
        return {"eval_loss": (totals[0] / totals[1]).item(), "eval_samples": int(totals[1].item())}

    def _emit(self, hook: str, *args: object) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)


class _NoWatchdog:
    """Stands in for HangWatchdog when --collective-timeout is 0."""

    def phase(self, step: int, name: str) -> None:
        pass
