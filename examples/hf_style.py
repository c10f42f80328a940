"""A HuggingFace-style model on ddpkit.Run: dict batches in, ``{"loss": ..., "logits": ...}`` out.

    ddpkit run --nproc 2 examples/hf_style.py --out runs/hf_style --save-every 20

The model computes its own loss from ``labels``, the way transformers' models do, so the loop
is ``outputs = model(**batch); run.backward(outputs["loss"])``. The data is character windows of
the Python documentation that ships with CPython. At the end the example checks that the loss
fell and that the exact held-out loss equals one process's loss on the whole split.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.data.text import load_text

BLOCK = 32


class CharWindows(Dataset):
    """``{"input_ids": (BLOCK,), "labels": (BLOCK,)}`` dicts: windows of text and the next characters."""

    def __init__(self, text: str, vocab: list[str], windows: int, offset: int) -> None:
        index = {ch: i for i, ch in enumerate(vocab)}
        self.ids = torch.tensor([index[ch] for ch in text[offset : offset + windows * BLOCK + 1]])
        self.windows = windows

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.ids[i * BLOCK : i * BLOCK + BLOCK + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


class TinyLM(nn.Module):
    """A causal one-layer transformer that returns its loss, as ``transformers`` models do."""

    def __init__(self, vocab_size: int, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.zeros(BLOCK, width))
        self.block = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1], device=input_ids.device)
        hidden = self.block(self.embed(input_ids) + self.position, src_mask=mask, is_causal=True)  # (B, T, C)
        logits = self.head(hidden)  # (B, T, vocab)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


def main(args) -> None:
    run = ddpkit.Run(
        out=args.out, global_batch=16, micro_batch=args.micro_batch, save_every=args.save_every,
        steps=args.steps, log_every=5, progress=False,
    )  # fmt: skip
    text = load_text(None)
    vocab = sorted(set(text))
    train, held_out = CharWindows(text, vocab, 640, 0), CharWindows(text, vocab, 64, 640 * BLOCK + 1)
    model = run.setup(TinyLM(len(vocab)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=args.steps)
    run.track(optimizer=optimizer, scheduler=scheduler)
    loader = run.loader(train)
    while run.step < args.steps:  # epoch after epoch; the loader stops at Run(steps=...)
        for batch in loader:
            train_step(run, model, optimizer, scheduler, batch)
    evaluated = run.evaluate(held_out, lambda batch: model(**batch)["loss"], batch_size=5)["value"]
    check(run, model.module, held_out, evaluated)
    run.finish()


def train_step(run: ddpkit.Run, model: nn.Module, optimizer, scheduler, batch: dict) -> None:
    outputs = model(**batch)
    optimizer.zero_grad()
    run.backward(outputs["loss"])
    optimizer.step()
    scheduler.step()


def check(run: ddpkit.Run, model: nn.Module, held_out: CharWindows, evaluated: float) -> None:
    model.eval()
    with torch.no_grad():
        everything = {
            k: torch.stack([held_out[i][k] for i in range(len(held_out))]) for k in ("input_ids", "labels")
        }
        alone = model(**{k: v.to(run.device) for k, v in everything.items()})["loss"].item()
    assert abs(evaluated - alone) <= 1e-5 * alone, (
        f"distributed held-out loss {evaluated} != one process's {alone}"
    )
    assert alone < 3.5, f"the held-out loss did not fall below 3.5 (uniform would be 4.6): {alone:.3f}"
    run.print(f"hf_style: step {run.step} on {run.env.world_size} processes; held-out loss {alone:.3f}")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="run folder (none: no files, no checkpoints)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (40 is one epoch)")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--save-every", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
