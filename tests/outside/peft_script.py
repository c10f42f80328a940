"""A user's LoRA fine-tuning script: a tiny transformers GPT-2 wrapped by peft, trained on ddpkit.Run.

    ddpkit run --nproc 2 tests/outside/peft_script.py --out runs/lora
    ddpkit run --nproc 2 tests/outside/peft_script.py --out runs/lora --kill-at 9  # then again

Written as a single-device peft loop would be: the base model (here built from a config under
``transformers.set_seed``, where a user would load pretrained weights), ``get_peft_model`` with a
``LoraConfig`` on GPT-2's ``c_attn``, dict batches, ``model(**batch).loss``, AdamW over
``model.parameters()`` (the frozen base has no gradient and is left alone) and
``get_linear_schedule_with_warmup``; only the ``run.`` lines are ddpkit's.

What the run writes is what tests/outside/test_peft_lora.py checks: OUT/metrics.jsonl (the loss
of every step), OUT/model.pt (the PeftModel's state dict, written by ``run.finish()``) and
OUT/adapter/ (peft's own ``save_pretrained`` of the adapter, on rank 0 after the run).

Flags: --out, --kill-at STEP (rank 0 SIGKILLs itself at the end of that step).
"""

import argparse
import os
import signal

import peft
import torch
import transformers
from torch.utils.data import Dataset

import ddpkit

SEQ = 16
VOCAB = 32
EPOCHS = 2
SEQUENCES = 44  # an epoch is 6 steps of 8, the last one of 4
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "lora_dropout": 0.0, "fan_in_fan_out": True}


class CountingSequences(Dataset):
    """``{"input_ids": (SEQ,), "labels": (SEQ,)}``: runs ``start, start+stride, ...`` mod VOCAB, from
    a fixed generator (the same data on every rank and in every run)."""

    def __init__(self, size: int, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (size, 1), generator=generator)
        stride = torch.randint(1, 4, (size, 1), generator=generator)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB  # (size, SEQ)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def build_base() -> transformers.GPT2LMHeadModel:
    """The base GPT-2: the same weights wherever it is built (set_seed), a pretrained model's stand-in."""
    transformers.set_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def build_model() -> peft.PeftModel:
    """The base GPT-2 with LoRA on c_attn: only lora_A and lora_B require grad."""
    return peft.get_peft_model(build_base(), peft.LoraConfig(task_type="CAUSAL_LM", **LORA))


def main(args: argparse.Namespace) -> None:
    run = ddpkit.Run(out=args.out, global_batch=8, save_every=2, log_every=1, progress=False)
    model = run.setup(build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    loader = run.loader(CountingSequences(SEQUENCES))
    scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=2, num_training_steps=EPOCHS * len(loader)
    )
    run.track(optimizer, scheduler)
    for _ in range(loader.epoch, EPOCHS):
        for batch in loader:
            loss = model(**batch).loss
            optimizer.zero_grad()
            run.backward(loss)
            optimizer.step()
            scheduler.step()
            if run.step == args.kill_at and run.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    run.finish()  # OUT/model.pt: the PeftModel's state dict
    if run.is_main:  # peft's own file of the adapter, to compare with OUT/model.pt
        ddpkit.unwrap(model).save_pretrained(os.path.join(args.out, "adapter"))


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="run folder: metrics.jsonl, model.pt, adapter/")
    parser.add_argument("--kill-at", type=int, default=0, help="rank 0 SIGKILLs itself at this step's end")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
