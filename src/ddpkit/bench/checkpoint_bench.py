"""``ddpkit bench checkpoint``: what a checkpoint costs a run, against the plain ways to write one.

For each process count (``--nproc 1,2``) and engine (``torch``, ``fsdp``), one launch trains a
GPT of about 30M parameters with AdamW through ``ddpkit.Run`` and times, in alternating rounds
(medians over ``--rounds``):

- ``step``: a training step without a save;
- ``save``: the checkpoint a step boundary writes (what ``save_every`` and ``run.save()`` add to
  a step), synchronous: written, hashed and renamed;
- ``plain``: what the seeds' tutorials do with the same state: ``torch.save`` of the model's and
  optimizer's state dicts on rank 0 (torch engine), or ``dcp.save`` of the shards (fsdp), fsynced;
- ``async save + step``: the same checkpoint with ``async_save=True`` and the next step, which
  runs while the thread writes (on a CPU the two share the cores; on fsdp every rank's thread
  writes its shards).

Then ``resume``: the seconds from ``ddpkit.Run(...)`` to the end of the first step, resuming
from the last checkpoint, against the same from a fresh folder (``fresh``), and ``load``: a
plain ``torch.load`` of the plain save (``dcp.load`` on fsdp). Goals (issue 35): a synchronous
save at most 1.2x the plain save, a step with an async save at most 1.2x a step, a resume at
most the fresh start plus DCP's load plus 10%.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddpkit
from ddpkit.errors import OneLineParser
from ddpkit.launch import launch
from ddpkit.models import GPT, GPTConfig
from ddpkit.run.engine import unwrap


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=6, n_head=8, n_embd=640))  # 29.6M


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _plain_save(model, optimizer, folder: Path, engine: str) -> None:
    if engine == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder / "dcp"))
    elif dist.get_rank() == 0:
        path = folder / "plain.pt"
        torch.save({"model": unwrap(model).state_dict(), "optim": optimizer.state_dict()}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())


def _session(out: str, engine: str, async_save: bool) -> tuple:
    """A Run with the GPT and AdamW; its model, optimizer and a function for one step. An epoch is
    one step (12 samples, global batch 12), so after ``step()`` the run is between epochs, where
    ``run.save()`` checkpoints at once: the save is timed alone, through the public API."""
    run = ddpkit.Run(out=out, engine=engine, global_batch=12, progress=False, async_save=async_save)
    model = run.setup(_gpt())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run.track(optimizer)
    data = torch.randint(0, 128, (12, 65), generator=torch.Generator().manual_seed(0))
    loader = run.loader(torch.utils.data.TensorDataset(data))

    def step() -> None:
        for (x,) in loader:
            logits = model(x[:, :-1])
            optimizer.zero_grad()
            run.backward(F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)))
            optimizer.step()

    return run, model, optimizer, step


def _plain_load(model, optimizer, folder: Path, engine: str) -> None:
    if engine == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder / "dcp"))
    else:
        torch.load(folder / "plain.pt", weights_only=True)


def _rank(engine: str, rounds: int, folder: str) -> dict:
    os.environ["DDPKIT_LOG_LEVEL"] = "error"  # the resumed session's early exit is not news here
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # each round's dcp.save
    times: dict[str, list[float]] = {"step": [], "save": [], "plain": [], "async": [], "load": []}
    out = Path(folder) / engine
    run, model, optimizer, step = _session(str(out / "sync"), engine, False)
    step()  # warm-up: AdamW's state exists from here on
    for _ in range(rounds):
        times["step"].append(_timed(step))
        times["save"].append(_timed(run.save))  # between epochs: the checkpoint, now
        times["plain"].append(_timed(lambda: _plain_save(model, optimizer, out, engine)))
        times["load"].append(_timed(lambda: _plain_load(model, optimizer, out, engine)))
    run.close()  # no final checkpoint: the last run.save() is what the resume below starts from
    run, model, optimizer, step = _session(str(out / "async"), engine, True)
    step()
    for _ in range(rounds):
        times["async"].append(_timed(lambda: (run.save(), step())))
        time.sleep(2.0)  # the thread's write (about 0.5 s here) lands before the next round
    run.finish()  # waits for the last write: a run.close() would leave its thread writing
    resume = {}
    for kind, path in (("resume", out / "sync"), ("fresh", out / "fresh")):
        start = time.perf_counter()
        run, _, _, step = _session(str(path), engine, False)
        step()
        dist.barrier()
        resume[kind] = time.perf_counter() - start
        run.close()
    return {"times": times, "start": resume}


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="ddpkit bench checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", default="1,2", help="process counts, comma-separated")
    parser.add_argument("--engines", default="torch,fsdp")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    rows = []
    print(
        "# ddpkit bench checkpoint: GPT 29.6M parameters + AdamW (356 MB of state), medians over rounds (s)"
    )
    print(
        f"{'nproc':>5} {'engine':>6} {'step':>7} {'save':>7} {'plain':>7} {'save/plain':>10} "
        f"{'async+step':>10} {'/step':>6} {'fresh':>7} {'resume':>7} {'load':>7}"
    )
    for nproc in (int(n) for n in ns.nproc.split(",")):
        for engine in ns.engines.split(","):
            with tempfile.TemporaryDirectory(prefix="ddpkit-bench-ckpt-") as folder:
                ranks = launch(_rank, nproc, (engine, ns.rounds, folder))
            med = {k: statistics.median(v) if v else float("nan") for k, v in ranks[0]["times"].items()}
            start = {k: max(r["start"][k] for r in ranks) for k in ("fresh", "resume")}
            rows.append({"nproc": nproc, "engine": engine, "median_s": med, "start_s": start})
            print(
                f"{nproc:>5} {engine:>6} {med['step']:7.3f} {med['save']:7.3f} {med['plain']:7.3f} "
                f"{med['save'] / med['plain']:10.2f} {med['async']:10.3f} {med['async'] / med['step']:6.2f} "
                f"{start['fresh']:7.2f} {start['resume']:7.2f} {med['load']:7.2f}",
                flush=True,
            )
    print("goals: save/plain <= 1.2; async save + step <= 1.2 x step; resume <= fresh + DCP's load + 10%")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0
