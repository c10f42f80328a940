"""A minGPT-style character model trained with DDP, in the shape of the DDP tutorials' multigpu.py Trainer.

    ddpkit run --nproc 2 examples/mingpt.py

Trains ddpkit's GPT on the default corpus (CPython's documentation topics, so no download) for
a few dozen steps, then checks that the loss fell well below that of a uniform guess over the
characters and that every rank ends with the same weights, and prints a short sample from rank 0.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler

import ddpkit
from ddpkit.data.text import CharDataset, CharTokenizer, load_text
from ddpkit.models import GPT, GPTConfig

STEPS = 40
BATCH_PER_RANK = 16


class Trainer:
    """Runs steps on this rank's shard; the same class would train on one device unchanged."""

    def __init__(self, model: GPT, loader: DataLoader, env: ddpkit.DistEnv) -> None:
        self.env, self.loader = env, loader
        device_ids = [env.local_rank] if env.device.type == "cuda" else None
        self.model = DDP(model.to(env.device), device_ids=device_ids)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        logits = self.model(x.to(self.env.device))  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(self.env.device).flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # gradients are all-reduced bucket by bucket during backward
        self.optimizer.step()
        return loss.item()

    def train(self, steps: int) -> list[float]:
        losses, epoch = [], 0
        while len(losses) < steps:
            self.loader.sampler.set_epoch(epoch)  # a new shuffle, still disjoint across ranks
            for x, y in self.loader:
                losses.append(self._run_batch(x, y))
                if len(losses) == steps:
                    break
            epoch += 1
        return losses


def global_mean(values: list[float], device: torch.device) -> float:
    """Mean over these values and over ranks: one all_reduce, so every rank gets the same number."""
    t = torch.tensor([sum(values) / len(values)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def main() -> None:
    env = ddpkit.init_distributed()
    try:
        torch.manual_seed(0)
        text = load_text(None)
        tokenizer = CharTokenizer(text)
        model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size))
        dataset = CharDataset(tokenizer.encode(text), model.config.block_size)
        sampler = DistributedSampler(dataset, env.world_size, env.rank, shuffle=True, seed=0)
        trainer = Trainer(model, DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler), env)
        losses = trainer.train(STEPS)

        first, last = global_mean(losses[:5], env.device), global_mean(losses[-5:], env.device)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        copies = [torch.empty_like(flat) for _ in range(env.world_size)]
        dist.all_gather(copies, flat)
        for rank, copy in enumerate(copies):
            assert_close(copy, flat, rtol=0, atol=0, msg=lambda m, rank=rank: f"rank {rank} differs: {m}")
        uniform = math.log(tokenizer.vocab_size)  # the loss of knowing nothing
        assert last < min(first, uniform - 1.0), f"loss {first:.3f} -> {last:.3f} (uniform {uniform:.2f})"
        if env.is_rank0:
            prompt = tokenizer.encode("The ").view(1, -1).to(env.device)  # (1, 4)
            sample = model.generate(prompt, 60, temperature=0.8, top_k=10)
            print(f"mingpt: {env.world_size} ranks, {STEPS} steps, loss {first:.2f} -> {last:.2f}")
            print(f"sample: {tokenizer.decode(sample[0].cpu())!r}")
    finally:
        ddpkit.destroy()


if __name__ == "__main__":
    main()
