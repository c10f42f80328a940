"""transformers' run_clm_no_trainer.py loop shape on ddpkit.Run, for a finished run run again.

A step budget (``--max-train-steps``, handed to ``steps=``), an epoch loop sized from it as the
script sizes it, a checkpoint asked for at each epoch's end (``--checkpointing-steps epoch``:
``run.save()``, no ``save_every``) and, after the loop, code that reads a value the loop sets
(the perplexity written to all_results.json on rank 0): a run that trained nothing would fail
there. tests/run/test_run_finished.py runs it twice under `ddpkit run`.

Flags: --out, --max-train-steps N, --checkpointing-steps (epoch or a number of steps),
--report-to (unused: a flag a user adds between runs).
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-train-steps", type=int, default=None)
    parser.add_argument("--checkpointing-steps", default="epoch")
    parser.add_argument("--report-to", default="all")
    args = parser.parse_args()
    every = int(args.checkpointing_steps) if args.checkpointing_steps.isdigit() else 0

    run = ddpkit.Run(
        out=args.out, global_batch=8, steps=args.max_train_steps, save_every=every, progress=False
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=gen)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    model = run.setup(nn.Linear(6, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = run.loader(data)
    epochs = math.ceil(args.max_train_steps / len(loader)) if args.max_train_steps else 2
    run.track(optimizer)
    for _epoch in range(loader.epoch, epochs):
        for inputs, targets in loader:
            loss = F.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            last_loss = loss.item()  # HF's loop keeps its own values: a loop that ran no step has none
        losses = run.evaluate(data, lambda batch: F.mse_loss(model(batch[0]), batch[1]))
        perplexity = math.exp(min(losses["value"], 20.0))
        if args.checkpointing_steps == "epoch":
            run.save()
    if run.is_main:  # rank 0 alone writes it: a NameError here leaves rank 1 in run.finish()
        with open(os.path.join(args.out, "all_results.json"), "w") as f:
            json.dump({"perplexity": perplexity, "train_loss": last_loss}, f)
    run.finish()


if __name__ == "__main__":
    main()
