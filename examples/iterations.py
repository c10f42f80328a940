"""An iteration-based loop, as nanoGPT writes one, on ddpkit.Run: a budget of steps, an lr set by
hand from the step number, random windows over a token array, evaluation on held-out windows
every few steps, and the best model kept (``run.save_best``).

    ddpkit run --nproc 2 examples/iterations.py --out runs/iterations

The step number: inside the loop ``run.step`` counts the step being trained, from 1; the lr of
nanoGPT's ``get_lr(it)``, with ``it`` from 0, is ``get_lr(run.step - 1)``. After the step (an
evaluation at ``run.at_step_end``) ``run.step`` is the number of steps done. The budget is
``steps=``: a counter of the loop's own would start at 0 again after a resume. Random windows
(nanoGPT's ``torch.randint(len(data) - block, (batch,))``) are a dataset of every window, shuffled
by the run from (seed, epoch), so a resume and any number of processes draw the same ones. The
data is the Python documentation that ships with CPython. At the end the example checks that the
held-out loss is well below a uniform guess's.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

import ddpkit
from ddpkit.data.text import CharTokenizer, load_text
from ddpkit.models.gpt import GPT, GPTConfig

BLOCK = 32


class Windows(Dataset):
    """Every window of ``BLOCK + 1`` tokens of ``data``: (input, the next tokens)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data) - BLOCK

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + BLOCK + 1]
        return chunk[:-1], chunk[1:]


def get_lr(it: int, iters: int, peak: float = 3e-3, warmup: int = 10) -> float:
    """nanoGPT's schedule: linear warm-up, then cosine decay to a tenth, ``it`` from 0."""
    if it < warmup:
        return peak * (it + 1) / warmup
    progress = (it - warmup) / max(1, iters - warmup)
    return peak / 10 + 0.5 * (peak - peak / 10) * (1 + math.cos(math.pi * progress))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/iterations")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=20)
    args = parser.parse_args()

    text = load_text(None)[:200_000]
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    cut = int(len(data) * 0.9)
    train = Windows(data[:cut])
    held = Windows(data[cut:])
    # A fixed random sample of held-out windows: the same ones at every evaluation.
    held = Subset(held, torch.randperm(len(held), generator=torch.Generator().manual_seed(0))[:256].tolist())

    run = ddpkit.Run(out=args.out, global_batch=16, steps=args.iters, save_every=args.save_every, log_every=1)
    model = run.setup(GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=2, n_embd=64)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=get_lr(0, args.iters), weight_decay=0.1)
    run.track(optimizer)
    loader = run.loader(train)

    def held_out_loss() -> float:
        return run.evaluate(held, lambda b: F.cross_entropy(model(b[0]).flatten(0, 1), b[1].flatten()))[
            "value"
        ]

    while run.step < args.iters:  # the loader stops every rank at the budget, mid-epoch or not
        for x, y in loader:
            for group in optimizer.param_groups:  # by hand, from the step being trained
                group["lr"] = get_lr(run.step - 1, args.iters)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            if run.at_step_end and run.step % args.eval_every == 0:  # every rank: a collective
                val = held_out_loss()
                run.log(val_loss=val)
                run.save_best(val)
    last = held_out_loss()
    run.finish()
    guess = math.log(tokenizer.vocab_size)  # the loss of a uniform guess, where training starts
    if run.is_main:
        print(
            f"iterations: {run.step} steps, held-out loss {last:.3f} (a uniform guess: {guess:.3f})",
            flush=True,
        )
    if not last < guess - 0.5:
        raise SystemExit(
            f"iterations: the held-out loss {last:.3f} is not below a uniform guess's {guess:.3f}"
        )


if __name__ == "__main__":
    main()
