"""The DDP tutorial's last demo: DDP over replicas that each span two devices (model parallel inside).

    ddpkit run --nproc 2 examples/ddp_model_parallel.py

Each process holds one replica split over two devices: GPUs 2r and 2r+1 where there are enough,
else "cpu" and "cpu" (the same code path, so it runs anywhere). A multi-device module is wrapped
without ``device_ids``; DDP then leaves input placement to the module's own forward.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

import ddpkit


class ToyMpModel(nn.Module):
    """ToyModel with its first layer on ``dev0`` and its second on ``dev1``."""

    def __init__(self, dev0: torch.device, dev1: torch.device) -> None:
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.net1 = nn.Linear(10, 10).to(dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5).to(dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))  # (B, 10) on dev0
        return self.net2(x.to(self.dev1))  # (B, 5) on dev1: the activation crosses devices here


def devices_for(env: ddpkit.DistEnv) -> tuple[torch.device, torch.device]:
    if torch.cuda.device_count() >= 2 * env.local_world_size:
        return torch.device("cuda", 2 * env.local_rank), torch.device("cuda", 2 * env.local_rank + 1)
    return torch.device("cpu"), torch.device("cpu")


def main() -> None:
    # gloo reduces tensors wherever they live; nccl would insist on one GPU per process.
    env = ddpkit.init_distributed("gloo")
    try:
        dev0, dev1 = devices_for(env)
        torch.manual_seed(0)
        model = ToyMpModel(dev0, dev1)
        reference = ToyMpModel(torch.device("cpu"), torch.device("cpu"))
        reference.load_state_dict(model.state_dict())
        ddp_model = DDP(model)  # no device_ids: the module spans devices itself
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        loss_fn = nn.MSELoss()

        gen = torch.Generator().manual_seed(0)  # the same stream on every rank: all ranks' data
        for _ in range(3):
            xs = torch.randn(env.world_size, 20, 10, generator=gen)  # (ranks, B, 10)
            ys = torch.randn(env.world_size, 20, 5, generator=gen)  # (ranks, B, 5)
            optimizer.zero_grad()
            outputs = ddp_model(xs[env.rank])  # on dev1
            loss_fn(outputs, ys[env.rank].to(dev1)).backward()
            optimizer.step()
            # DDP averages gradients, so this must match one model on every rank's samples.
            ref_optimizer.zero_grad()
            loss_fn(reference(xs.flatten(0, 1)), ys.flatten(0, 1)).backward()
            ref_optimizer.step()

        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert_close(p.detach().cpu(), ref.detach(), msg=lambda m, name=name: f"{name}: {m}")
        dist.barrier()
        if env.is_rank0:
            print(f"ddp_model_parallel: {env.world_size} replicas on ({dev0}, {dev1}) match one model")
    finally:
        ddpkit.destroy()


if __name__ == "__main__":
    main()
