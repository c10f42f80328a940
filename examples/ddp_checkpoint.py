"""The DDP tutorial's checkpoint demo: save on rank 0, barrier, load everywhere with map_location.

    ddpkit run --nproc 2 examples/ddp_checkpoint.py

Replicas are identical (same start, averaged gradients), so one process writing is enough. The
others must not read before the file is complete: that is what the barrier is for.
"""

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

import ddpkit
from ddpkit.models import ToyModel


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    optimizer.zero_grad()
    outputs = model(torch.randn(20, 10, device=device))
    nn.MSELoss()(outputs, torch.randn(20, 5, device=device)).backward()
    optimizer.step()


def shared_path(env: ddpkit.DistEnv) -> Path:
    """A fresh directory made by rank 0, its name sent to every rank."""
    box = [tempfile.mkdtemp(prefix="ddpkit-checkpoint-") if env.is_rank0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) / "model.pt"


def main() -> None:
    env = ddpkit.init_distributed()
    try:
        torch.manual_seed(env.rank)  # different inputs per rank; DDP still keeps replicas equal
        model = ToyModel().to(env.device)
        ddp_model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
        train_step(ddp_model, optimizer, env.device)

        path = shared_path(env)
        if env.is_rank0:
            torch.save(model.state_dict(), path)  # the inner module: no "module." prefix in the keys
        dist.barrier()  # nobody loads before rank 0 has finished writing

        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # as if this process had just started from scratch
        # map_location puts every tensor on this rank's device; without it each tensor goes back
        # to the device it was saved from, and all ranks would crowd onto rank 0's GPU.
        model.load_state_dict(torch.load(path, map_location=env.device, weights_only=True))
        for name, value in model.state_dict().items():
            assert_close(value, saved[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")

        train_step(ddp_model, optimizer, env.device)  # training goes on from the loaded weights
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        copies = [torch.empty_like(flat) for _ in range(env.world_size)]
        dist.all_gather(copies, flat)
        for rank, copy in enumerate(copies):
            assert_close(copy, flat, rtol=0, atol=0, msg=lambda m, rank=rank: f"rank {rank} differs: {m}")

        # No barrier needed before deleting: the all_gather above already waited for every
        # rank, and every rank finished loading before it.
        if env.is_rank0:
            shutil.rmtree(path.parent)
            print(f"ddp_checkpoint: saved on rank 0, loaded on {env.world_size} ranks, replicas identical")
    finally:
        ddpkit.destroy()


if __name__ == "__main__":
    main()
