"""The PyTorch DDP tutorials' MNIST ConvNet trained with DDP and a DistributedSampler, on handwritten digits.

    ddpkit run --nproc 2 examples/mnist_convnet.py

Uses scikit-learn's bundled 8x8 digits (1797 real images; no download) in place of MNIST.
Each rank sees a disjoint shard of every epoch; the script checks that the shards really are
disjoint and cover the data, and that the trained model gets 90% of held-out digits right.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, random_split

import ddpkit
from ddpkit.data.digits import load_digits
from ddpkit.models import ConvNet

EPOCHS = 4
BATCH_PER_RANK = 32


def check_shards(sampler: DistributedSampler, size: int, env: ddpkit.DistEnv) -> None:
    """Each index of the epoch belongs to exactly one rank (drop_last trims the remainder)."""
    mine = torch.zeros(size, device=env.device)
    mine[list(sampler)] = 1
    dist.all_reduce(mine)
    assert mine.max() == 1, "two ranks were given the same sample"
    assert mine.sum() == size - size % env.world_size, "some samples were given to nobody"


def main() -> None:
    env = ddpkit.init_distributed()
    try:
        torch.manual_seed(0)
        # Same split on every rank: a fixed generator, not the global seed.
        dataset, test_set = random_split(load_digits(), [1500, 297], torch.Generator().manual_seed(0))
        device_ids = [env.local_rank] if env.device.type == "cuda" else None
        model = DDP(ConvNet(image_size=8).to(env.device), device_ids=device_ids)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        sampler = DistributedSampler(dataset, env.world_size, env.rank, shuffle=True, drop_last=True)
        loader = DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)

        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)  # without it, every epoch replays the same order
            check_shards(sampler, len(dataset), env)
            for images, labels in loader:
                loss = F.cross_entropy(model(images.to(env.device)), labels.to(env.device))
                optimizer.zero_grad()
                loss.backward()  # DDP averages gradients; BatchNorm buffers come from rank 0
                optimizer.step()
            if env.is_rank0:
                print(f"epoch {epoch + 1}/{EPOCHS}: last batch loss {loss.item():.3f}")

        model.eval()  # BatchNorm now uses its running statistics (DDP copied rank 0's each forward)
        images, labels = (torch.stack(t) for t in zip(*test_set, strict=True))
        with torch.no_grad():
            predicted = model.module(images.to(env.device)).argmax(1).cpu()  # (297,)
        accuracy = (predicted == labels).float().mean().item()
        print(f"mnist_convnet: rank {env.rank}: held-out accuracy {accuracy:.1%}")
        assert accuracy >= 0.9, f"held-out accuracy {accuracy:.1%} is below 90%: training is broken"
    finally:
        ddpkit.destroy()


if __name__ == "__main__":
    main()
