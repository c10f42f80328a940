"""A user's HuggingFace training script: a tiny GPT-2 from transformers, trained on ddpkit.Run.

    ddpkit run --nproc 2 tests/outside/hf_client_script.py --out runs/hf --steps 12 --precision bf16
    ddpkit run --nproc 3 tests/outside/hf_client_script.py --out runs/hf --global-batch 12 \
        --dropout 0.1 --invariant-dropout

Written as a single-device transformers loop would be (dict batches, ``model(**batch).loss``,
AdamW, ``get_linear_schedule_with_warmup``); only the ``run.`` lines are ddpkit's. The model is
built from a config (no weights are downloaded) and the data is made here. What the run writes,
OUT/metrics.jsonl (loss and lr per step) and OUT/model.pt (the final weights), is what
tests/outside/test_transformers_client.py checks from the outside.
"""

import argparse

import torch
import transformers
from torch.utils.data import Dataset

import ddpkit

SEQ = 16
VOCAB = 64


class CountingSequences(Dataset):
    """``{"input_ids": (SEQ,), "labels": (SEQ,)}``: runs ``start, start+stride, ...`` mod VOCAB.

    Each sequence has its own start and stride (a fixed generator makes the same data on every
    rank and in every run), so the next token is learnable from the ones before it.
    """

    def __init__(self, size: int, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (size, 1), generator=generator)
        stride = torch.randint(1, 4, (size, 1), generator=generator)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB  # (size, SEQ)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # transformers' causal LMs shift the labels themselves: labels are the inputs.
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def main(args) -> None:
    run = ddpkit.Run(
        out=args.out, global_batch=args.global_batch, micro_batch=args.micro_batch or None, log_every=1,
        progress=False, steps=args.steps, precision=args.precision, invariant_dropout=args.invariant_dropout,
    )  # fmt: skip
    # Built after Run(...), which seeds torch on every rank: every rank builds the same weights.
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
        attn_implementation=args.attention,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    dataset = CountingSequences(size=args.global_batch * args.steps)  # one epoch is the whole run

    model = run.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=args.warmup, num_training_steps=args.steps
    )
    run.track(optimizer, scheduler)

    for batch in run.loader(dataset):
        out = model(**batch)
        optimizer.zero_grad()
        run.backward(out.loss)
        optimizer.step()
        scheduler.step()
    run.finish()
    run.print(
        f"hf_client_script: {run.step} steps on {run.env.world_size} processes ({args.precision}), "
        f"last micro-batch loss {out.loss.item():.4f}; loss {out.loss.dtype}, logits {out.logits.dtype}"
    )


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="run folder: metrics.jsonl, model.pt")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate, after warmup")
    parser.add_argument("--warmup", type=int, default=3, help="steps of linear warmup from 0")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per forward (0: a share)")
    parser.add_argument("--dropout", type=float, default=0.0, help="GPT-2's three dropouts (default 0.1)")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"], help="attn_implementation")
    parser.add_argument("--invariant-dropout", action="store_true", help="ddpkit.Run(invariant_dropout=True)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
