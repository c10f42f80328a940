"""The nn.DataParallel baseline of ``ddpkit bench scaling``: one process driving several GPUs by threads.

PyTorch's DDP tutorials compare it with DDP: every step DataParallel scatters the batch from GPU 0, copies
the model to every GPU, runs the replicas in Python threads (contending for the GIL) and
gathers the outputs back to GPU 0, where DDP keeps one long-lived replica per process and
all-reduces gradients while backward runs. Only meaningful with two or more GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.train.job import JobConfig
from ddpkit.train.trainer import make_optimizer
from ddpkit.train.workloads import get_workload


def _batches(loader: DataLoader) -> Iterator:
    while True:
        yield from loader


def dataparallel_throughput(cfg: JobConfig, ngpus: int, warmup: int) -> tuple[float, float]:
    """(samples per second, seconds per step) of nn.DataParallel over GPUs 0 .. ngpus - 1, in this process.

    Args:
        cfg: the workload, steps and global batch, as for the DDP runs.
        ngpus: GPUs to spread each batch over.
        warmup: leading steps left out of the timing.
    """
    torch.manual_seed(cfg.run.seed)
    job = get_workload(cfg.train.task).build(cfg)
    model = nn.DataParallel(job.model.cuda(0), device_ids=list(range(ngpus)))
    optimizer = make_optimizer(model.parameters(), cfg.train.lr, cfg.train.weight_decay)
    loader = DataLoader(job.dataset, batch_size=cfg.data.global_batch, shuffle=True, drop_last=True)
    batches, start = _batches(loader), time.perf_counter()
    for step in range(cfg.run.steps):
        if step == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        x, y = (t.cuda(0, non_blocking=True) for t in next(batches))
        loss = job.loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / (cfg.run.steps - warmup)
    return cfg.data.global_batch / seconds, seconds
