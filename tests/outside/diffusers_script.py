"""diffusers' train_unconditional.py in small, ported to ddpkit.Run: a DDPM trained to predict noise.

    ddpkit run --nproc 2 tests/outside/diffusers_script.py --out runs/ddpm --steps 12
    ddpkit run --nproc 2 tests/outside/diffusers_script.py --out runs/ddpm --kill-at 7  # then again

The loop is diffusers' own (a ``UNet2DModel``, ``DDPMScheduler.add_noise``, the MSE on the predicted
noise, AdamW, ``get_scheduler("cosine")``, an ``EMAModel`` with its decay warm-up stepped once per
optimizer step), with the lines porting.md gives: the noise and the timesteps drawn per sample by
``run.randn_like`` and ``run.randint`` (torch.randn/randint would draw other numbers on another
number of processes), ``run.backward``, the EMA stepped under ``if run.at_step_end:`` and tracked
with ``run.track(ema=ema)``. The model is built from arguments and the images are made here.

What the run writes is what tests/outside/test_diffusers_ddpm.py checks: OUT/metrics.jsonl (the
loss of every step), OUT/model.pt (the weights), OUT/ema.pt (the EMA's averaged weights, written
by ``run.finish()``), and OUT/unet-ema/ (diffusers' own way: ``ema.copy_to`` then
``save_pretrained``, on rank 0 after the run).

Flags: --out, --steps, --kill-at STEP (rank 0 SIGKILLs itself at the end of that step).
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch.utils.data import Dataset

import ddpkit

SIZE = 8  # image side
IMAGES = 54  # an epoch is 5 steps of 12, the last one of 6
T = 100  # diffusion timesteps


class Blobs(Dataset):
    """``{"input": (1, SIZE, SIZE)}`` in [-1, 1]: smooth random images, a 2x2 grid upsampled, from a
    fixed generator (the same on every rank and in every run)."""

    def __init__(self, size: int, seed: int = 1234) -> None:
        coarse = torch.rand(size, 1, 2, 2, generator=torch.Generator().manual_seed(seed))
        self.images = F.interpolate(coarse, size=(SIZE, SIZE), mode="bilinear", align_corners=False) * 2 - 1

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input": self.images[i]}


def main(args: argparse.Namespace) -> None:
    run = ddpkit.Run(
        out=args.out, global_batch=12, steps=args.steps, save_every=2, log_every=1, progress=False
    )
    unet = UNet2DModel(
        sample_size=SIZE, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(4, 8),
        norm_num_groups=2, attention_head_dim=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    )  # fmt: skip
    noise_scheduler = DDPMScheduler(num_train_timesteps=T)
    model = run.setup(unet)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-3, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8
    )
    lr_scheduler = get_scheduler(
        "cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=args.steps
    )
    # train_unconditional.py's EMA: its warm-up (inv_gamma, power), made after run.setup.
    ema = EMAModel(
        model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=3 / 4,
        model_cls=UNet2DModel, model_config=unet.config,
    )  # fmt: skip
    ema.to(run.device)
    run.track(optimizer, lr_scheduler, ema=ema)

    loader = run.loader(Blobs(IMAGES))
    while run.step < args.steps:  # the run stops every rank at step --steps, mid-epoch or not
        for batch in loader:
            clean_images = batch["input"]
            noise = run.randn_like(clean_images)  # per sample: the same on any number of processes
            timesteps = run.randint(T, like=clean_images)
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
            model_output = model(noisy_images, timesteps).sample
            loss = F.mse_loss(model_output.float(), noise.float())
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            if run.at_step_end:  # diffusers steps its EMA on accelerator.sync_gradients
                ema.step(model.parameters())
                if run.step == args.kill_at and run.rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
    run.finish()  # OUT/model.pt, and OUT/ema.pt: the EMA's averaged weights
    if run.is_main:  # diffusers' own way to the EMA's weights, to compare with OUT/ema.pt
        ema.copy_to(unet.parameters())
        unet.save_pretrained(os.path.join(args.out, "unet-ema"))


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="run folder: metrics.jsonl, model.pt, ema.pt")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--kill-at", type=int, default=0, help="rank 0 SIGKILLs itself at this step's end")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
