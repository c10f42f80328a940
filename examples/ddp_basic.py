"""The DDP tutorial's basic use case: ToyModel in DistributedDataParallel, checked against one process.

    ddpkit run --nproc 2 examples/ddp_basic.py

Each rank trains on its own 20 samples. Because DDP averages gradients across ranks, a step
must equal one ordinary step on all ranks' samples together, and every replica must match.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

import ddpkit
from ddpkit.models import ToyModel

BATCH_PER_RANK = 20
STEPS = 3


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s samples at ``step``, reproducible anywhere: x (20, 10), y (20, 5)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH_PER_RANK, 10, generator=gen), torch.randn(BATCH_PER_RANK, 5, generator=gen)


def full_batch(world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(batch(r, step) for r in range(world_size)), strict=True)
    return torch.cat(xs), torch.cat(ys)


def main() -> None:
    env = ddpkit.init_distributed()
    try:
        torch.manual_seed(0)  # the reference below starts from the same weights
        reference = ToyModel()
        model = ToyModel().to(env.device)
        model.load_state_dict(reference.state_dict())
        # DDP broadcasts rank 0's weights and registers one autograd hook per parameter; the
        # hooks all-reduce gradient buckets while backward is still running.
        ddp_model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        loss_fn = nn.MSELoss()

        for step in range(STEPS):
            x, y = batch(env.rank, step)
            optimizer.zero_grad()
            loss_fn(ddp_model(x.to(env.device)), y.to(env.device)).backward()  # grads arrive averaged
            optimizer.step()

            x_all, y_all = full_batch(env.world_size, step)
            ref_optimizer.zero_grad()
            loss_fn(reference(x_all), y_all).backward()
            ref_optimizer.step()

        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert_close(p.detach().cpu(), ref.detach(), msg=lambda m, name=name: f"{name}: {m}")
        dist.barrier()
        if env.is_rank0:
            print(
                f"ddp_basic: {STEPS} DDP steps on {env.world_size} ranks match one process on the full batch"
            )
    finally:
        ddpkit.destroy()


if __name__ == "__main__":
    main()
