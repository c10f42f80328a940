"""A GAN on ddpkit.Run: two models, two optimizers, two backward passes per batch.

    ddpkit run --nproc 2 examples/gan.py --out runs/gan --save-every 20

The generator learns to map noise onto a ring of radius 2 around the origin; the discriminator
learns to tell its points from real ones. Both models are set up (wrapped, checkpointed) under
their own names, and each optimizer is tracked. At the end the example checks that the
generated points lie near the ring and that both replicas of both models agree.

The generator's pass uses the discriminator stepped just before it, as on one device. With
``micro_batch`` that step would wait for the step's last micro-batch (ddpkit says so in one
line): there, step the two models on alternate steps (``if run.step % 2:``), which
tests/run/test_run_invariance.py holds to one process under micro_batch.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ddpkit

NOISE = 8


class Ring(Dataset):
    """Points on a circle of radius 2, with a little radial noise."""

    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(0)
        angle = 2 * math.pi * torch.rand(size, generator=gen)
        radius = 2 + 0.05 * torch.randn(size, generator=gen)
        self.points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)  # (size, 2)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.points[i]


def mlp(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(inputs, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, outputs)
    )


def main(args) -> None:
    run = ddpkit.Run(
        out=args.out,
        global_batch=64,
        save_every=args.save_every,
        steps=args.steps,
        log_every=10,
        progress=False,
    )
    generator = run.setup(mlp(NOISE, 2), name="generator")
    discriminator = run.setup(mlp(2, 1), name="discriminator")
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    run.track(opt_generator=opt_g, opt_discriminator=opt_d)
    loader = run.loader(Ring(2048))
    while run.step < args.steps:
        for real in loader:
            fake = generator(torch.randn(len(real), NOISE, device=run.device))
            # The discriminator: real points are 1, generated ones 0 (one forward over both).
            scores = discriminator(torch.cat([real, fake.detach()]))
            labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)]).to(run.device)
            opt_d.zero_grad()
            run.backward(F.binary_cross_entropy_with_logits(scores, labels))
            opt_d.step()
            # The generator: make the discriminator call its points real. The discriminator is
            # frozen for this pass, so its gradient gets nothing from the generator's loss (and
            # its forward is a plain one, with no all-reduce to prepare).
            discriminator.requires_grad_(False)
            opt_g.zero_grad()
            run.backward(
                F.binary_cross_entropy_with_logits(discriminator(fake), torch.ones_like(scores[: len(real)]))
            )
            opt_g.step()
            discriminator.requires_grad_(True)
    check(run, generator.module)
    run.finish()


def check(run: ddpkit.Run, generator: nn.Module) -> None:
    with torch.no_grad():
        points = generator(
            torch.randn(1000, NOISE, generator=torch.Generator().manual_seed(1)).to(run.device)
        )
    radius = points.norm(dim=1).median().item()
    assert 1.6 < radius < 2.4, f"the generated points' median radius is {radius:.2f}, not near the ring's 2"
    run.print(f"gan: step {run.step} on {run.env.world_size} processes; median radius {radius:.2f} (ring: 2)")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="run folder (none: no files, no checkpoints)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-every", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
