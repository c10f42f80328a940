"""Does PowerSGD still learn? The bench GPT trained with and without it, side by side.

``python -m ddpkit.bench.powersgd_loss [--seed N] [STEPS] [NPROC] [SETTING ...]`` trains copies of the engine
bench's 4.8M-parameter GPT on the character corpus (``ddpkit.data.text``): one with plain
``DataParallel`` and one per SETTING with PowerSGD (error feedback and warm start on), all on the
same batches. A SETTING is ``RANK`` or ``RANK:START_ITER``, PowerSGD's ``matrix_approximation_rank``
and its plain all-reduce steps (default 10), as in ``compression="powersgd:RANK:START_ITER"``;
the default is ``1``, torch's rank. It prints the mean loss of the last 20 steps of each run, its
ratio to the uncompressed one and the seconds its steps took. The loss does not depend on the
link, so this runs on loopback; the seconds are loopback's, not a link's.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpkit.bench.engine_rounds import VOCAB, EngineBenchConfig
from ddpkit.data.text import CharTokenizer, load_text
from ddpkit.dist import destroy, init_distributed
from ddpkit.launch import launch
from ddpkit.parallel import DataParallel
from ddpkit.parallel.compression import parse_powersgd

TAIL = 20  # steps averaged at the end


def _batch(
    data: torch.Tensor, cfg: EngineBenchConfig, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - cfg.seq - 1, (cfg.batch,), generator=gen)
    windows = torch.stack([data[s : s + cfg.seq + 1] for s in starts.tolist()])  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def _rank(steps: int, settings: tuple[str, ...], seed: int) -> dict[str, dict[str, list[float] | float]]:
    env = init_distributed("gloo")
    try:
        cfg = EngineBenchConfig()
        text = load_text(None)
        data = CharTokenizer(text).encode(text)
        assert int(data.max()) < VOCAB, f"the corpus has {int(data.max()) + 1} symbols, the GPT {VOCAB}"
        torch.manual_seed(seed)
        base = cfg.gpt()
        models = {"native": DataParallel(copy.deepcopy(base))}
        for setting in settings:
            hook = parse_powersgd(f"powersgd:{setting}")
            models[f"powersgd:{setting}"] = DataParallel(copy.deepcopy(base), compression=hook)
        optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
        # Each rank its own batches, the same for every run; seed 0 keeps the README's numbers.
        gen = torch.Generator().manual_seed(1000 * seed + env.rank)
        runs = {k: {"losses": [], "seconds": 0.0} for k in models}
        for _ in range(steps):
            x, y = _batch(data, cfg, gen)
            for name, model in models.items():
                start = time.perf_counter()
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (B*T, V) vs (B*T,)
                optims[name].zero_grad(set_to_none=True)
                loss.backward()
                optims[name].step()
                runs[name]["seconds"] += time.perf_counter() - start
                mean = loss.detach().clone()
                dist.all_reduce(mean)  # the world's mean loss
                runs[name]["losses"].append(mean.item() / env.world_size)
        return runs
    finally:
        destroy()


def main(argv: list[str]) -> int:
    """Print each run's final loss, its ratio to the uncompressed run and its seconds; 0."""
    seed = 0
    if argv[:1] == ["--seed"]:
        seed, argv = int(argv[1]), argv[2:]
    steps = int(argv[0]) if argv else 300
    nproc = int(argv[1]) if len(argv) > 1 else 2
    settings = tuple(argv[2:]) or ("1",)
    for setting in settings:
        parse_powersgd(f"powersgd:{setting}")  # a bad setting fails here, before any process starts
    runs = launch(_rank, nproc, (steps, settings, seed))[0]
    tails = {k: statistics.mean(v["losses"][-TAIL:]) for k, v in runs.items()}
    print(f"# {nproc} processes, {steps} steps, seed {seed}, mean loss of the last {TAIL} steps, AdamW 1e-3")
    print(f"{'run':<16} {'first':>6} {'last':>7} {'/ native':>9} {'seconds':>8}")
    for name, value in tails.items():
        first, seconds = runs[name]["losses"][0], runs[name]["seconds"]
        print(f"{name:<16} {first:>6.3f} {value:>7.4f} {value / tails['native']:>9.4f} {seconds:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
