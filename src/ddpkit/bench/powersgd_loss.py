"""Does PowerSGD still learn? The bench GPT trained with and without it, side by side.

``python -m ddpkit.bench.powersgd_loss [STEPS] [NPROC] [RANK]`` trains two copies of the engine bench's
4.8M-parameter GPT on the character corpus (``ddpkit.data.text``), one with ``DataParallel`` and
one with ``PowerSGD(matrix_approximation_rank=RANK)`` (default 1; error feedback on, 10 plain
warm-up steps), on the same batches, and prints the mean loss of the last 20 steps of each and their
ratio. The loss does not depend on the link, so this runs on loopback.
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpkit.bench.engine import VOCAB, EngineBenchConfig
from ddpkit.data.text import CharTokenizer, load_text
from ddpkit.dist import destroy, init_distributed
from ddpkit.launch import launch
from ddpkit.parallel import DataParallel, PowerSGD

TAIL = 20  # steps averaged at the end


def _batch(
    data: torch.Tensor, cfg: EngineBenchConfig, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - cfg.seq - 1, (cfg.batch,), generator=gen)
    windows = torch.stack([data[s : s + cfg.seq + 1] for s in starts.tolist()])  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def _rank(steps: int, rank: int) -> dict[str, list[float]]:
    env = init_distributed("gloo")
    try:
        cfg = EngineBenchConfig()
        text = load_text(None)
        data = CharTokenizer(text).encode(text)
        assert int(data.max()) < VOCAB, f"the corpus has {int(data.max()) + 1} symbols, the GPT {VOCAB}"
        torch.manual_seed(0)
        base = cfg.gpt()
        models = {
            "native": DataParallel(copy.deepcopy(base)),
            "powersgd": DataParallel(base, compression=PowerSGD(matrix_approximation_rank=rank)),
        }
        optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
        gen = torch.Generator().manual_seed(env.rank)  # each rank its own batches, the same for both
        losses: dict[str, list[float]] = {k: [] for k in models}
        for _ in range(steps):
            x, y = _batch(data, cfg, gen)
            for name, model in models.items():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (B*T, V) vs (B*T,)
                optims[name].zero_grad(set_to_none=True)
                loss.backward()
                optims[name].step()
                mean = loss.detach().clone()
                dist.all_reduce(mean)  # the world's mean loss
                losses[name].append(mean.item() / env.world_size)
        return losses
    finally:
        destroy()


def main(argv: list[str]) -> int:
    """Print both runs' final losses and their ratio; 0."""
    steps = int(argv[0]) if argv else 300
    nproc = int(argv[1]) if len(argv) > 1 else 2
    rank = int(argv[2]) if len(argv) > 2 else 1
    losses = launch(_rank, nproc, (steps, rank))[0]
    tails = {k: statistics.mean(v[-TAIL:]) for k, v in losses.items()}
    print(f"# {nproc} processes, {steps} steps, PowerSGD rank {rank}, mean loss of the last {TAIL} steps")
    for name, value in tails.items():
        print(f"{name:<10} first {losses[name][0]:.3f}  last {value:.4f}")
    print(f"powersgd / native: {tails['powersgd'] / tails['native']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
