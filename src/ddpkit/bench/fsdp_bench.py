"""``ddpkit bench fsdp``: what engine="fsdp" holds per process, and what its step costs.

For each process count (``--nproc 1,2,3``) and each engine (``torch``: a full copy per process;
``fsdp``: FSDP2 shards), one launch trains the GPT a few steps with AdamW through ddpkit's own
``wrap`` and reports, per rank, the bytes of parameters, gradients (after backward) and optimizer
state it holds (a DTensor counts its local shard), and its peak memory (on the CPU the growth of peak
RSS over the process before the model, activations and temporaries included;
``torch.cuda.max_memory_allocated`` on a GPU). The goal for the sharded part on N processes: at
most 1.1 x 1/N of the full copy's. Then, on ``--time-nproc`` processes, both engines take turns
in rounds of steps on one launch and the ratio fsdp / torch of the median step is printed, with
the median of per-round ratios (load that drifts between rounds cancels out).
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpkit.dist import current_env, destroy, init_distributed
from ddpkit.errors import OneLineParser
from ddpkit.launch import launch
from ddpkit.models import GPT, GPTConfig
from ddpkit.run.config import EngineConfig
from ddpkit.run.engine.wrap import wrap

ENGINES = ("torch", "fsdp")
GOAL = 1.1  # the sharded part on N processes: at most GOAL / N of the full copy's bytes


def local_bytes(tensors) -> int:
    """Bytes this process holds of ``tensors``: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def build(engine: str, layers: int, width: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The GPT (the same on every rank) wrapped by ddpkit's engine, and AdamW over it."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=layers, n_head=4, n_embd=width))
    model = wrap(model, current_env(), EngineConfig(engine=engine))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One training step on next-token prediction; leaves the gradients in place (not zeroed)."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(x[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).backward()
    optimizer.step()


def memory_rank(engine: str, layers: int, width: int, steps: int) -> dict:
    """On every rank of a launch: the bytes this rank holds after ``steps`` steps of ``engine``."""
    env = init_distributed("gloo")
    try:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch and ddpkit loaded
        model, optimizer = build(engine, layers, width)
        x = torch.randint(0, 128, (8, 65), generator=torch.Generator().manual_seed(env.rank))
        for _ in range(steps):
            step(model, optimizer, x)
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        # The growth of peak RSS (KiB on Linux) over what the process held before the model.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        if env.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(env.device)
        return {
            "params": local_bytes(model.parameters()),
            "grads": local_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": local_bytes(state),
            "peak": peak,
        }
    finally:
        destroy()


def time_rank(layers: int, width: int, rounds: int, per_round: int) -> dict:
    """Both engines on one launch, a block of ``per_round`` steps each per round; step times in s."""
    env = init_distributed("gloo")
    try:
        built = {name: build(name, layers, width) for name in ENGINES}
        x = torch.randint(0, 128, (8, 65), generator=torch.Generator().manual_seed(env.rank))
        for name in ENGINES:  # warm-up
            step(*built[name], x)
        times: dict[str, list[float]] = {name: [] for name in ENGINES}
        for r in range(rounds):
            for name in ENGINES[r % 2 :] + ENGINES[: r % 2]:  # alternate which engine goes first
                dist.barrier()
                began = time.perf_counter()
                for _ in range(per_round):
                    step(*built[name], x)
                dist.barrier()
                times[name].append((time.perf_counter() - began) / per_round)
        return times
    finally:
        destroy()


def table(memory: dict[int, dict[str, list[dict]]]) -> tuple[str, dict]:
    """The memory table (the most any rank holds) and each sharded part's fraction of full / N."""
    rows = [
        "| processes | engine | params MB | grads MB | optimizer MB | part / (full / N) | peak growth MB |"
    ]
    rows.append("|---|---|---|---|---|---|---|")
    fractions = {}
    full = {k: max(r[k] for r in memory[min(memory)]["torch"]) for k in ("params", "grads", "optimizer")}
    for n, engines in sorted(memory.items()):
        for name, ranks in engines.items():
            most = {k: max(r[k] for r in ranks) for k in ("params", "grads", "optimizer", "peak")}
            part = sum(most[k] for k in full) / (sum(full.values()) / n)
            fractions[f"{name}@{n}"] = part
            mb = [f"{most[k] / 1e6:.2f}" for k in ("params", "grads", "optimizer")]
            rows.append(f"| {n} | {name} | {' | '.join(mb)} | {part:.3f} | {most['peak'] / 1e6:.0f} |")
    return "\n".join(rows), fractions


def main(argv: list[str]) -> int:
    """``ddpkit bench fsdp``: prints the memory table and the step-time ratio; 0 on success."""
    p = OneLineParser(prog="ddpkit bench fsdp", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", default="1,2,3", help="process counts of the memory table (default 1,2,3)")
    p.add_argument("--n-layer", type=int, default=6, help="GPT blocks (default 6)")
    p.add_argument("--n-embd", type=int, default=256, help="GPT width (default 256: 4.8M parameters)")
    p.add_argument("--steps", type=int, default=3, help="steps before the memory is read (default 3)")
    p.add_argument("--time-nproc", type=int, default=2, help="processes of the timing (0: none)")
    p.add_argument("--rounds", type=int, default=6, help="timing rounds (default 6)")
    p.add_argument("--per-round", type=int, default=5, help="steps per engine per round (default 5)")
    p.add_argument("--json", type=Path, help="write the results to this file")
    ns = p.parse_args(argv)
    counts = [int(n) for n in ns.nproc.split(",") if n.strip()]
    memory = {
        n: {e: launch(memory_rank, n, (e, ns.n_layer, ns.n_embd, ns.steps)) for e in ENGINES} for n in counts
    }
    text, fractions = table(memory)
    print(f"# ddpkit bench fsdp: GPT n_layer={ns.n_layer} n_embd={ns.n_embd}, AdamW, the most any rank holds")
    print(text)
    result = {"memory": {str(n): v for n, v in memory.items()}, "fractions": fractions, "goal": GOAL}
    if ns.time_nproc:
        times = launch(time_rank, ns.time_nproc, (ns.n_layer, ns.n_embd, ns.rounds, ns.per_round))[0]
        ratios = [f / t for f, t in zip(times["fsdp"], times["torch"], strict=True)]
        med = {name: statistics.median(times[name]) for name in ENGINES}
        print(
            f"step time on {ns.time_nproc} processes: torch {med['torch'] * 1e3:.0f} ms, fsdp "
            f"{med['fsdp'] * 1e3:.0f} ms; fsdp / torch {statistics.median(ratios):.3f} "
            f"(per-round ratios {min(ratios):.3f} to {max(ratios):.3f})"
        )
        result["times"] = times
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0
