"""``ddpkit bench bitwise``: what ``ddpkit.Run(bitwise=True)`` costs a step, against the default mode.

For each process count (``--nproc 1,2,4``) and model (``--models default,30m``), one launch
trains ddpkit's GPT with AdamW through ``ddpkit.Run`` in both modes, in alternating blocks of
``--steps`` steps (which goes first flips every round), and times each step from the loop's
view (the first step of a block, which builds the run, is left out). The ratio bitwise /
default is the median of the rounds' ratios of their median steps, with a 90% interval. A third
variant, the default mode on one intra-op thread a process (``1 thread``), tells the price of the
mode's thread count from the price of its grains and tree (``bitwise / 1 thread``).

What the mode changes, and so what the ratio holds: one backward a grain of ``global_batch /
grains`` samples instead of one a rank's share (small grains use a CPU's or GPU's width less),
the grains' sums kept in a tree (log2 partial copies of the gradients), the ranks' sums added
by recursive halving and doubling over point-to-point sends instead of bucketed all-reduces
overlapping the backward, deterministic kernels, and on the CPU one intra-op thread per process
where the default gives each process its share of the cores.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.bench.engine_summary import interval90
from ddpkit.errors import OneLineParser
from ddpkit.launch import launch
from ddpkit.models import GPT, GPTConfig

# name -> (the GPT's shape, global batch); the default is ddpkit train gpt's model and batch.
MODELS = {
    "default": (GPTConfig(), 64),
    "30m": (GPTConfig(vocab_size=128, block_size=64, n_layer=6, n_head=8, n_embd=640), 8),
}


def _block(model: str, mode: str, steps: int, device: str) -> float:
    """The median step time (s) of ``steps`` steps after a first one, in one mode."""
    threads = torch.get_num_threads()
    if mode == "1 thread":
        torch.set_num_threads(1)
    try:
        return _steps(model, mode == "bitwise", steps, device)
    finally:
        torch.set_num_threads(threads)


def _steps(model: str, bitwise: bool, steps: int, device: str) -> float:
    config, batch = MODELS[model]
    run = ddpkit.Run(global_batch=batch, drop_last=True, bitwise=bitwise, steps=steps + 1, progress=False)
    torch.manual_seed(0)
    net = run.setup(GPT(config))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    run.track(optimizer)
    tokens = torch.randint(0, config.vocab_size, (batch * (steps + 1), config.block_size + 1))
    began, times = None, []
    for (x,) in run.loader(TensorDataset(tokens)):
        logits = net(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        optimizer.zero_grad()
        run.backward(loss)
        optimizer.step()
        if run.at_step_end:
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if began is not None:
                times.append(now - began)
            began = now
    run.finish()
    return statistics.median(times)


def _rank(model: str, rounds: int, steps: int, device: str) -> dict:
    modes = ("default", "bitwise", "1 thread")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(rounds):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            times[mode].append(_block(model, mode, steps, device))
    return times


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="ddpkit bench bitwise", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", default="1,2,4", help="process counts, comma-separated")
    parser.add_argument("--models", default="default,30m", help=f"from {', '.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps a block")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    print(f"# ddpkit bench bitwise ({ns.device}): s/step, medians; ratios bitwise/default [90% interval]")
    head = ("default", "bitwise", "1 thread", "ratio", "interval", "/1 thread")
    print(
        f"{'nproc':>5} {'model':>8} " + " ".join(f"{h:>9}" for h in head[:4]) + f" {head[4]:>15} {head[5]:>9}"
    )
    rows = []
    for nproc in (int(n) for n in ns.nproc.split(",")):
        for model in ns.models.split(","):
            if model not in MODELS:
                parser.error(f"--models: unknown {model!r}; choose from {', '.join(MODELS)}")
            found = launch(_rank, nproc, (model, ns.rounds, ns.steps, ns.device))[0]
            ratios = [b / d for b, d in zip(found["bitwise"], found["default"], strict=True)]
            alone = [b / d for b, d in zip(found["bitwise"], found["1 thread"], strict=True)]
            low, high = interval90(ratios)
            row = {
                "nproc": nproc,
                "model": model,
                **{f"{mode}_s": statistics.median(found[mode]) for mode in found},
                "ratio": statistics.median(ratios),
                "interval": [low, high],
                "ratio_1_thread": statistics.median(alone),
            }
            rows.append(row)
            times = " ".join(f"{row[f'{mode}_s']:9.4f}" for mode in ("default", "bitwise", "1 thread"))
            print(
                f"{nproc:>5} {model:>8} {times} {row['ratio']:9.2f} [{low:6.2f}, {high:6.2f}] "
                f"{row['ratio_1_thread']:9.2f}",
                flush=True,
            )
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0
