"""A ddpkit.Run loop on one GPU in reduced precision, for tests/gpu/test_gpu_amp_resume.py.

A dropout layer on the GPU draws from the CUDA generator every step. ``--overflow-at STEP``
multiplies that step's loss by 2**20: under fp16 its gradients overflow, the GradScaler skips
the step and halves its scale (65536 -> 32768), state a resume has to bring back as well.
``--kill-at STEP`` SIGKILLs the process after that step. After ``run.finish()`` rank 0 writes
OUT/end_state.json: the device, the run's GradScaler state and the CUDA generator's state.

Flags: --out, --precision bf16|fp16, --overflow-at STEP, --kill-at STEP.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS = 3  # 64 samples in global batches of 16: 4 steps an epoch, 12 in all


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--precision", choices=("bf16", "fp16"), required=True)
    parser.add_argument("--overflow-at", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()
    # Deterministic kernels where torch has them (the test sets CUBLAS_WORKSPACE_CONFIG): the
    # rerun's steps must compute exactly what the uninterrupted run's did.
    torch.use_deterministic_algorithms(True, warn_only=True)

    run = ddpkit.Run(
        out=args.out, global_batch=16, micro_batch=8, save_every=2, log_every=1, progress=False,
        precision=args.precision,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=gen), torch.randint(0, 4, (64,), generator=gen))
    model = run.setup(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.25), nn.Linear(64, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run.track(optimizer)
    loader = run.loader(data)

    for _epoch in range(loader.epoch, EPOCHS):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            if run.step == args.overflow_at:
                loss = loss * 2.0**20  # fp16: inf gradients, a skipped step, a halved scale
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            if run.step == args.kill_at and run.at_step_end:
                os.kill(os.getpid(), signal.SIGKILL)
    run.finish()  # the last step's GradScaler update happens here
    if run.is_main:
        end = {
            "device": str(run.device),
            "scaler": run._scaler.state_dict(),  # the Run's own GradScaler ({} unless fp16)
            "cuda_rng": torch.cuda.get_rng_state(run.device).tolist(),
        }
        (Path(args.out) / "end_state.json").write_text(json.dumps(end), encoding="utf-8")


if __name__ == "__main__":
    main()
