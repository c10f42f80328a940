"""Callbacks: what happens around the loop (progress bar, metrics file, sample logs), kept out of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from tqdm import tqdm

from ddpkit.train.metrics import MetricsLog

if TYPE_CHECKING:
    from ddpkit.train.trainer import Trainer


class Callback:
    """Hooks the Trainer calls on every rank; override the ones you need."""

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, step: int, indices: list[int]) -> None: ...

    def on_log(self, trainer: Trainer, record: dict) -> None: ...

    def on_fit_end(self, trainer: Trainer) -> None: ...


class ProgressBar(Callback):
    """A tqdm bar on global rank 0 with loss and samples/s."""

    def on_fit_start(self, trainer: Trainer) -> None:
        self.bar = tqdm(
            total=trainer.total_steps,
            initial=trainer.step,
            unit="step",
            dynamic_ncols=True,
            disable=not trainer.env.is_rank0,
        )

    def on_step_end(self, trainer: Trainer, step: int, indices: list[int]) -> None:
        self.bar.update(1)

    def on_log(self, trainer: Trainer, record: dict) -> None:
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", samples_per_s=f"{record['samples_per_s']:.0f}")

    def on_fit_end(self, trainer: Trainer) -> None:
        self.bar.close()


class MetricsFile(Callback):
    """Rank 0 appends each logged record to OUT/metrics.jsonl (lines past a resumed step are dropped)."""

    def on_fit_start(self, trainer: Trainer) -> None:
        self.log = MetricsLog(trainer.out / "metrics.jsonl") if trainer.env.is_rank0 else None
        if self.log is not None:
            truncate_after(self.log.path, trainer.step)

    def on_log(self, trainer: Trainer, record: dict) -> None:
        if self.log is not None:
            self.log.write(record)


class SampleLog(Callback):
    """Each rank writes OUT/samples/rank{R}.jsonl: the dataset indices it consumed at each step."""

    def on_fit_start(self, trainer: Trainer) -> None:
        folder = trainer.out / "samples"
        self.path = folder / f"rank{trainer.env.rank}.jsonl"
        if trainer.env.is_rank0:
            # A resumed run (maybe at another world size) redoes the steps after its checkpoint:
            # drop them from every rank's log, including ranks this run no longer has.
            folder.mkdir(parents=True, exist_ok=True)
            for path in folder.glob("rank*.jsonl"):
                truncate_after(path, trainer.step)
        dist.barrier()  # no rank appends before rank 0 has truncated

    def on_step_end(self, trainer: Trainer, step: int, indices: list[int]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "indices": indices}) + "\n")


def truncate_after(path: Path, step: int) -> None:
    """Drop lines logged after ``step``: a resumed run redoes those steps and logs them again."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
