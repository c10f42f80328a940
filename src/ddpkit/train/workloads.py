"""Built-in workloads from PyTorch's DDP tutorials: a character GPT, the MNIST ConvNet and the ToyModel.

A workload is a task like any ``ddpkit train path/to/task.py``: ``build(cfg)`` returns a
``ddpkit.Task`` (model, dataset, loss, held-out split, and what to show of the trained model).
Each also carries the defaults that make ``ddpkit train WORKLOAD`` learn visibly in minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, Subset

from ddpkit.errors import ConfigError
from ddpkit.train.task import Task


@dataclass(frozen=True)
class Workload:
    """A named built-in task and the settings that make it learn visibly on a laptop in minutes.

    Args:
        name: the name on the command line.
        data_kind: what --data must point at: ``file``, ``dir`` or None (takes no --data).
        build: makes the Task from the job's config.
        defaults: config fields (any section's) this workload sets unless the user does.
    """

    name: str
    data_kind: str | None
    build: Callable[[Any], Task]
    defaults: dict[str, Any] = field(default_factory=dict)


HELD_OUT = 0.1  # the last tenth of every dataset is the evaluation split


def split_off(dataset: Dataset) -> tuple[Subset, Subset]:
    """First 90% for training, last 10% held out: a fixed split, the same on every rank and run."""
    cut = int(len(dataset) * (1 - HELD_OUT))
    return Subset(dataset, range(cut)), Subset(dataset, range(cut, len(dataset)))


def _gpt_task(cfg: Any) -> Task:
    from ddpkit.data.text import CharDataset, CharTokenizer, load_text
    from ddpkit.models.gpt import GPT, GPTConfig

    text = load_text(cfg.train.data)
    tokenizer = CharTokenizer(text)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size))
    data = tokenizer.encode(text)
    cut = int(len(data) * (1 - HELD_OUT))
    block = model.config.block_size
    dataset, held_out = CharDataset(data[:cut], block), CharDataset(data[cut:], block)

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B*T, V) vs (B*T,)

    def finish(trained: nn.Module) -> str:
        prompt = tokenizer.encode("\n").view(1, -1)  # (1, 1)
        generator = torch.Generator().manual_seed(cfg.run.seed)
        device = next(trained.parameters()).device
        out = trained.generate(prompt.to(device), 300, temperature=0.8, top_k=20, generator=generator)
        return tokenizer.decode(out[0].tolist())

    return Task(model, dataset, loss_fn, eval_dataset=held_out, finish=finish)


def _convnet_task(cfg: Any) -> Task:
    from ddpkit.data.digits import load_digits, load_mnist
    from ddpkit.models.convnet import ConvNet

    dataset = load_mnist(cfg.train.data) if cfg.train.data else load_digits()
    image_size = dataset[0][0].shape[-1]
    train, held_out = split_off(dataset)
    model = ConvNet(num_classes=10, image_size=image_size)
    return Task(model, train, F.cross_entropy, eval_dataset=held_out)


def _toy_task(cfg: Any) -> Task:
    from ddpkit.data.synthetic import ToyDataset
    from ddpkit.models.toy import ToyModel

    train, held_out = split_off(ToyDataset(num_samples=4096, seed=cfg.run.seed))
    return Task(ToyModel(), train, F.mse_loss, eval_dataset=held_out)


def _defaults(steps: int, global_batch: int, lr: float, warmup_steps: int, save_every: int) -> dict:
    return {
        "steps": steps,
        "global_batch": global_batch,
        "lr": lr,
        "warmup_steps": warmup_steps,
        "save_every": save_every,
        "grad_clip": 1.0,
    }


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        # 1000 steps of 64 windows: within the 3-minute goal on a busy 2-core machine, with room
        # (time and loss measured in docs/commands.md). Tuned over lr 3e-3..1e-2 and 1-4 layers.
        # Every workload checkpoints by default, so `ddpkit inspect` and `--resume auto` have one.
        Workload("gpt", "file", _gpt_task, _defaults(1000, 64, 6e-3, 50, save_every=250)),
        Workload("convnet", "dir", _convnet_task, _defaults(300, 64, 2e-3, 20, save_every=100)),
        Workload("toy", None, _toy_task, _defaults(200, 64, 1e-2, 10, save_every=50)),
    )
}


def get_workload(name: str) -> Workload:
    """The workload called ``name``, or a one-line error listing the ones that exist."""
    if name not in WORKLOADS:
        raise ConfigError(
            f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}, or give a task file "
            "path/to/task.py (or package.module:build) that returns ddpkit.Task"
        )
    return WORKLOADS[name]


def check_data(work: Workload, data: str | None) -> None:
    """--data must be what the workload reads: a file, a folder, or nothing."""
    if data is None:
        return
    if work.data_kind is None:
        raise ConfigError(f"workload {work.name} makes its own data and takes no --data; leave --data out")
    path = Path(data)
    if work.data_kind == "file" and not path.is_file():
        raise ConfigError(f"--data {data!r} is not a file; give a UTF-8 text file, or leave --data out")
    if work.data_kind == "dir" and not path.is_dir():
        raise ConfigError(
            f"--data {data!r} is not a directory; give a directory of MNIST IDX files, "
            "or leave --data out for the bundled digits"
        )
