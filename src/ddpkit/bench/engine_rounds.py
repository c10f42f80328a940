"""The engines ``ddpkit bench engine`` compares, and the timed rounds every rank runs.

Every rank holds one copy of the same GPT per engine; the engines take turns, a block of steps
each, in rotating order, on the same data. Engines:

  solo          rank 0 trains alone while the other ranks wait: the one-process baseline
  none          every rank trains its own copy without communication: the upper bound
  torch         torch.nn.parallel.DistributedDataParallel
  native        ddpkit.DataParallel; native+bf16, native+fp16, native+powersgd compress
  native+powersgd:R[:S]  PowerSGD at matrix_approximation_rank R (and S plain steps first);
                native+powersgd is rank 1 after 10 plain steps (torch's rank)
  native@1mib   native with torch DDP's bucket layout (a 1 MiB first bucket, overlapping
                backward), instead of the CPU default of one bucket
  native@NMB    native with buckets of N MiB each (``native@2mb``), first and last included;
                native@25mb is one bucket. Plain ``native`` picks its layout in its first steps

A step's time is the slowest rank's (steps start at a barrier); CPU time counts all threads.
Bytes and collectives per step come from torch.profiler's gloo events in one extra step. The
loopback run (``engine_bench``) and the link run (``engine_link``) both measure with ``measure``.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import ConfigError
from ddpkit.models import GPT, GPTConfig
from ddpkit.parallel import DataParallel
from ddpkit.parallel.compression import parse_powersgd
from ddpkit.parallel.layout import TRIAL_PASSES

ENGINES = ("solo", "none", "torch", "native", "native+bf16", "native+fp16", "native+powersgd", "native@1mib")
DEFAULT_ENGINES = "solo,none,torch,native,native+bf16"
# --link's default. PowerSGD at rank 8 (10 plain steps first): the rank that keeps the loss after
# 300 steps within 3.5% of uncompressed (python -m ddpkit.bench.powersgd_loss; docs/engine.md,
# "PowerSGD's rank and the loss", has the losses per seed).
LINK_ENGINES = "none,torch,native,native@1mib,native+bf16,native+powersgd:8"
VOCAB = 128
_CAP = re.compile(r"native@([0-9.]+)mb")
_POWERSGD = re.compile(r"native\+(powersgd(:[0-9]+){1,2})")  # native+powersgd:RANK[:START_ITER]
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4}


@dataclass(frozen=True)
class EngineBenchConfig:
    """What ``ddpkit bench engine`` runs.

    Args:
        engines: engine names, each from ENGINES.
        n_layer: GPT blocks; with n_embd 256 and 6 layers the GPT has 4.8M parameters (19 MB).
        n_embd: GPT width.
        n_head: attention heads.
        seq: tokens per sample (the GPT's block_size).
        batch: samples per rank per step.
        blocks: rounds; in each, every engine runs one block of steps.
        steps_per_block: timed steps per engine per round.
        warmup: untimed steps per engine first (buckets are rebuilt after the first).
        threads: intra-op threads per process; 0 keeps ddpkit's share (cores // processes).
    """

    engines: tuple[str, ...] = tuple(DEFAULT_ENGINES.split(","))
    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 8
    seq: int = 128
    batch: int = 8
    blocks: int = 12
    steps_per_block: int = 2
    warmup: int = 2
    threads: int = 0

    def __post_init__(self) -> None:
        patterns = (_CAP, _POWERSGD)
        unknown = [e for e in self.engines if e not in ENGINES and not any(p.fullmatch(e) for p in patterns)]
        if unknown or not self.engines:
            raise ConfigError(
                f"--engines {','.join(self.engines)!r} has unknown names {unknown}; "
                f"choose from {', '.join(ENGINES)}, native@NMB for buckets of N MiB, "
                "or native+powersgd:RANK[:START_ITER]"
            )
        for name in self.engines:
            if _POWERSGD.fullmatch(name):
                parse_powersgd(name.partition("+")[2])  # rank 0 or start_iter 1: its one-line error
        for name in ("n_layer", "n_embd", "n_head", "seq", "batch", "blocks", "steps_per_block"):
            if getattr(self, name) < 1:
                flag = f"--{name.replace('_', '-')}"
                raise ConfigError(f"{flag} {getattr(self, name)} is below 1; use a positive integer")
        if self.threads < 0:
            raise ConfigError(f"--threads {self.threads} is negative; use 0 (ddpkit's share) or a count")

    def gpt(self) -> GPT:
        """The benchmark's model, initialized from the current torch seed."""
        shape = {"n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd}
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=self.seq, **shape))


def wrap(name: str, model: nn.Module) -> nn.Module:
    """The model as engine ``name`` trains it."""
    if name in ("solo", "none"):
        return model
    if name == "torch":
        return DistributedDataParallel(model)
    if name == "native@1mib":
        return DataParallel(model, first_bucket_mb=1)
    cap = _CAP.fullmatch(name)
    if cap:
        return DataParallel(model, bucket_cap_mb=float(cap[1]), first_bucket_mb=float(cap[1]))
    compression = name.partition("+")[2] or None
    return DataParallel(model, compression=compression)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor) -> None:
    """One step, as the Trainer runs it."""
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (B*T, V) vs (B*T,)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def setup_engines(cfg: EngineBenchConfig, rank: int, names: tuple[str, ...]):
    """This rank's GPT, each engine's copy of it and optimizer, and its batch:
    ``(base, models, optimizers, x, y)``, models and optimizers keyed by engine name."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)  # before DataParallel, which warns if oversubscribed
    torch.manual_seed(0)
    base = cfg.gpt()
    gen = torch.Generator().manual_seed(1000 + rank)  # data differs by rank, not by engine
    x = torch.randint(0, VOCAB, (cfg.batch, cfg.seq), generator=gen)  # (B, T)
    y = torch.randint(0, VOCAB, (cfg.batch, cfg.seq), generator=gen)
    models = {name: wrap(name, copy.deepcopy(base)) for name in names}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=3e-4) for name, m in models.items()}
    return base, models, optims, x, y


def warmup_steps(cfg: EngineBenchConfig, name: str) -> int:
    """Untimed steps before ``name`` is timed: on top, the native engine's layout trial (where it
    picks its layout) and PowerSGD's plain all-reduce steps."""
    trial = TRIAL_PASSES if name.startswith("native") and "@" not in name else 0
    compression = name.partition("+")[2]
    plain = parse_powersgd(compression).start_iter if compression.startswith("powersgd") else 0
    return cfg.warmup + max(trial, plain)


def _run_block(name, model, optimizer, x, y, steps: int, rank: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()  # every step starts together, so the slowest rank's time is the step's
        if name == "solo" and rank != 0:
            continue  # wait in the next barrier while rank 0 trains alone
        start = time.perf_counter()
        train_step(model, optimizer, x, y)
        times.append(time.perf_counter() - start)
    dist.barrier()
    return times


def _comm_per_step(model, optimizer, x, y) -> tuple[int, int]:
    """(collective calls, bytes) of one step, from the gloo events torch.profiler records."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        train_step(model, optimizer, x, y)
    calls = nbytes = 0
    for event in prof.profiler.kineto_results.events():
        if event.name().startswith("gloo:"):
            calls += 1
            for shape, dtype in zip(event.shapes(), event.dtypes(), strict=False):
                nbytes += _DTYPE_BYTES.get(dtype, 4) * int(torch.Size(shape).numel())
    return calls, nbytes


def _rounds(cfg: EngineBenchConfig, args: dict, rank: int) -> tuple[dict, dict]:
    """Each engine's step times, per round; and the CPU and wall seconds its blocks took here."""
    rounds: dict[str, list[list[float]]] = {name: [] for name in cfg.engines}
    spent = {name: [0.0, 0.0] for name in cfg.engines}
    for block in range(cfg.blocks):
        k = block % len(cfg.engines)  # rotate, so no engine always runs right after another
        for name in cfg.engines[k:] + cfg.engines[:k]:
            cpu, wall = time.process_time(), time.perf_counter()
            rounds[name].append(_run_block(*args[name], cfg.steps_per_block, rank))
            spent[name][0] += time.process_time() - cpu  # all threads: compute, gloo, autograd
            spent[name][1] += time.perf_counter() - wall
    return rounds, spent


def measure(cfg: EngineBenchConfig, rank: int, world_size: int, extra=None) -> dict:
    """The timed rounds on this rank, gathered from every rank; ``extra(base, x, y)`` adds a
    dict of this rank's own measurements (the link bench's probes) under "extra"."""
    base, models, optims, x, y = setup_engines(cfg, rank, cfg.engines)
    args = {name: (name, models[name], optims[name], x, y) for name in cfg.engines}
    for name in cfg.engines:
        _run_block(*args[name], warmup_steps(cfg, name), rank)
    rounds, spent = _rounds(cfg, args, rank)
    comm = {name: _comm_per_step(*args[name][1:]) for name in cfg.engines if name != "solo"}
    trials = {name: getattr(getattr(m, "reducer", None), "trial", None) for name, m in models.items()}
    chosen = {name: trial.describe() for name, trial in trials.items() if trial is not None}
    mine = {"rounds": rounds, "spent": spent, "comm": comm, "layouts": chosen}
    if extra is not None:
        mine["extra"] = extra(base, x, y)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    params, threads = sum(p.numel() for p in base.parameters()), torch.get_num_threads()
    return {"ranks": everyone, "params": params, "threads": threads, "nproc": world_size}
