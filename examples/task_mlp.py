"""Your own model under ``ddpkit train``: a file that defines ``build(cfg)`` returning ``ddpkit.Task``.

    ddpkit train examples/task_mlp.py --nproc 2 --global-batch 64 --epochs 3 --eval-every 20

Every ``ddpkit train`` flag works for it (--micro-batch, --save-every, --resume auto,
--max-restarts, --engine native, --precision bf16, --config run.toml, ...). The data is
scikit-learn's bundled handwritten digits (8x8 images, 10 classes): nothing is downloaded.
The task brings its own optimizer and LR scheduler; leave them out for AdamW with --lr and
warmup-cosine.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Subset

import ddpkit
from ddpkit.data.digits import load_digits


def build(cfg) -> ddpkit.Task:
    """Called in every process after ddpkit seeded it; ``cfg.train.lr`` etc. are the job's settings."""
    digits = load_digits()  # (1, 8, 8) images scaled to [0, 1], labels 0..9
    cut = int(len(digits) * 0.9)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return ddpkit.Task(
        model=model,
        dataset=Subset(digits, range(cut)),
        eval_dataset=Subset(digits, range(cut, len(digits))),
        loss_fn=F.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=cfg.train.lr, momentum=0.9),
        scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7),
    )
