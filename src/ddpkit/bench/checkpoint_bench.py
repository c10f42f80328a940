"""``ddpkit bench checkpoint``: what a checkpoint costs a run, against the plain ways to write one.

For each process count (``--nproc 1,2``) and engine (``torch``, ``fsdp``), one launch trains a
GPT of about 30M parameters with AdamW through ``ddpkit.Run`` and times, in alternating rounds
(medians over ``--rounds``):

- ``step``: a training step without a save;
- ``save``: the checkpoint a step boundary writes (what ``save_every`` and ``run.save()`` add to
  a step), synchronous: written, hashed and renamed;
- the plain ways to save the same state, fsynced: ``torch.save`` of the model's and optimizer's
  state dicts on rank 0 into a new file renamed over the last (what a save that may be killed
  needs), the same over one path (``overwrite``: what the tutorials do, which a kill mid-write
  loses), and ``dcp.save`` on every rank into a new folder, the last one removed (torch engine:
  full state dicts; fsdp: the shards);
- ``async save + step``: the same checkpoint with ``async_save=True`` and the next step, which
  runs while the thread writes (on a CPU the two share the cores; on fsdp every rank's thread
  writes its shards), beside ``plain async``: the plainest background save of the same state
  (a host copy and a thread's ``torch.save`` on rank 0, or ``dcp.async_save``) and the step, the
  floor of saving in the background on this machine.

Beside the times, the bytes each rank reads from files (``/proc/self/io``'s ``rchar``, plus the
DCP files hashed through a mapping; the most of any rank) in a save (``read@save``: nothing is
read back to hash it) and in a resumed start (``read@resume``), against the checkpoint's bytes
over the ranks (``S/N``): every rank hashes state.pt, which it then maps, and the DCP files it
loads back itself, which its loads read through the same mapping.

Then the start-up, from ``ddpkit.Run(...)`` to the loop's first batch (every part restored),
resuming from the last checkpoint (``resumed``) and from a fresh folder (``fresh``), and the
plain load of the same form: what a plain script resuming does with a new optimizer
(``dcp.load`` of the state dicts, set back; or ``torch.load`` and ``load_state_dict``). The
start ends at the first batch, not after the first step: the step's compute is the same in both
and varies more on a busy machine than the load itself; the extra is the median over rounds of
each round's resumed start less its fresh one.
Goals: a synchronous save at most 1.2x the plain save of the same bytes in the same
form (``dcp.save`` when the run's checkpoint goes through DCP, else ``torch.save`` into a new
file), a step with an async save at most 1.2x a step, a resumed start at most the fresh one
plus DCP's load plus 10%.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddpkit
from ddpkit.bench import plain_checkpoint as plain
from ddpkit.checkpoint.files import mapped_bytes
from ddpkit.errors import OneLineParser
from ddpkit.launch import launch
from ddpkit.models import GPT, GPTConfig


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=6, n_head=8, n_embd=640))  # 29.6M


def _timed(fn, *args) -> float:
    """Seconds of ``fn(*args)`` on this rank, started together, once the disk has taken every write
    before it (``os.sync``): no save pays for the writeback of the ones before, which would
    otherwise land on ddpkit's, the first after each step."""
    os.sync()
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    dist.barrier()
    return time.perf_counter() - start


def _read_calls() -> int:
    """Bytes this process has read from files so far: through read calls (Linux ``rchar``; -1
    elsewhere) and the checkpoint files hashed through a mapping, which read calls do not see."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:")) + mapped_bytes()
    except (OSError, StopIteration):
        return -1


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

    def step() -> float:
        """One step; when its first batch came (every part of a resumed checkpoint restored)."""
        first = None
        for (x,) in loader:
            first = time.perf_counter() if first is None else first
            logits = model(x[:, :-1])
            optimizer.zero_grad()
            run.backward(F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)))
            optimizer.step()
        return first

    return run, model, optimizer, step


def _rank(engine: str, rounds: int, folder: str) -> dict:
    os.environ["DDPKIT_LOG_LEVEL"] = "error"  # the resumed session's early exit is not news here
    names = (
        "step",
        "save",
        "torch.save",
        "overwrite",
        "dcp.save",
        "torch.load",
        "dcp.load",
        "async",
        "plain async",
    )
    times: dict[str, list[float]] = {name: [] for name in names}
    read = {"save": 0, "resume": 0}  # the most any round read
    out = Path(folder) / engine
    run, model, optimizer, step = _session(str(out / "sync"), engine, False)
    step()  # warm-up: AdamW's state exists from here on
    for i in range(rounds):
        times["step"].append(_timed(step))
        before = _read_calls()
        times["save"].append(_timed(run.save))  # between epochs: the checkpoint, now
        read["save"] = max(read["save"], _read_calls() - before)
        if engine != "fsdp":  # a full state dict on rank 0 is not what a sharded run saves
            times["torch.save"].append(_timed(plain.torch_save, model, optimizer, out / "plain.pt", True))
            times["overwrite"].append(_timed(plain.torch_save, model, optimizer, out / "plain.pt", False))
            times["torch.load"].append(_timed(plain.torch_load, model, out / "plain.pt"))
        last = out / f"dcp-{i - 1}" if i else None
        times["dcp.save"].append(_timed(plain.dcp_save, model, optimizer, out / f"dcp-{i}", last))
        times["dcp.load"].append(_timed(plain.dcp_load, model, out / f"dcp-{i}"))
    through_dcp = any((out / "sync" / "checkpoints").glob("step-*/.metadata"))
    run.close()  # no final checkpoint: the last run.save() is what the resume below starts from
    run, model, optimizer, step = _session(str(out / "async"), engine, True)
    step()
    group, started = dist.new_group(backend="gloo"), []

    def plain_async_then_step(path: Path) -> None:
        started.append(plain.plain_async(model, optimizer, path, engine, group))
        step()

    for i in range(rounds):
        times["async"].append(_timed(lambda: (run.save(), step())))
        time.sleep(2.0)  # the thread's write (docs/fsdp.md has its time) lands before the next round
        times["plain async"].append(_timed(plain_async_then_step, out / f"plain-async-{i}"))
        started.pop()()
        time.sleep(2.0)
    run.finish()  # waits for the last write: a run.close() would leave its thread writing
    starts: dict[str, list[float]] = {"resume": [], "fresh": []}
    for i in range(rounds):  # alternated, as the rest: one start alone is at the machine's mercy
        for kind, path in (("resume", out / "sync"), ("fresh", out / f"fresh-{i}")):
            start, before = time.perf_counter(), _read_calls()
            run, _, _, step = _session(str(path), engine, False)
            starts[kind].append(step() - start)
            dist.barrier()
            if kind == "resume":
                read["resume"] = max(read["resume"], _read_calls() - before)
            run.close()
    last = sorted((out / "sync" / "checkpoints").glob("step-*"))[-1]
    size = sum(f.stat().st_size for f in last.iterdir())
    return {"times": times, "starts": starts, "through_dcp": through_dcp, "read": read, "bytes": size}


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
    head = (
        "step",
        "save",
        "torch.save",
        "overwrite",
        "dcp.save",
        "save/same",
        "async+step",
        "plain async",
        "/step",
    )
    print(f"{'nproc':>5} {'engine':>6} " + " ".join(f"{h:>10}" for h in head), end="")
    print(" " + " ".join(f"{h:>8}" for h in ("fresh", "resumed", "load", "extra/load")), end="")
    print(" " + " ".join(f"{h:>11}" for h in ("read@save", "read@resume", "S/N")))
    for nproc in (int(n) for n in ns.nproc.split(",")):
        for engine in ns.engines.split(","):
            with tempfile.TemporaryDirectory(prefix="ddpkit-bench-ckpt-") as folder:
                ranks = launch(_rank, nproc, (engine, ns.rounds, folder))
            med = {k: statistics.median(v) if v else float("nan") for k, v in ranks[0]["times"].items()}
            # A start ends when the last rank's first batch comes: the slowest rank's, per round.
            rounds = {
                k: list(map(max, zip(*(r["starts"][k] for r in ranks), strict=True)))
                for k in ("resume", "fresh")
            }
            start = {k: statistics.median(v) for k, v in rounds.items()}
            extra = statistics.median(r - f for r, f in zip(rounds["resume"], rounds["fresh"], strict=True))
            # The plain save of the same bytes in the same form: DCP's, or a new file on rank 0.
            dcp_form = ranks[0]["through_dcp"]
            same = med["dcp.save"] if dcp_form else med["torch.save"]
            load = med["dcp.load"] if dcp_form else med["torch.load"]
            ratios = {
                "save/same": med["save"] / same,
                "async/step": med["async"] / med["step"],
                "extra/load": extra / load,
            }
            mb = {k: max(r["read"][k] for r in ranks) / 2**20 for k in ("save", "resume")}
            share = ranks[0]["bytes"] / nproc / 2**20
            rows.append(
                {"nproc": nproc, "engine": engine, "median_s": med, "start_s": start, **ratios}
                | {"read_mb": mb, "share_mb": share}
            )
            cells = [med[k] for k in head[:5]] + [ratios["save/same"], med["async"], med["plain async"]]
            cells.append(ratios["async/step"])
            print(f"{nproc:>5} {engine:>6} " + " ".join(f"{c:10.3f}" for c in cells), end="")
            ends = (start["fresh"], start["resume"], load, ratios["extra/load"])
            print(" " + " ".join(f"{c:8.2f}" for c in ends), end="")
            print(" " + " ".join(f"{c:9.1f}MB" for c in (mb["save"], mb["resume"], share)), flush=True)
    print(
        "save/same: the save over the plain save of the same bytes in the same form (dcp.save when the\n"
        "  run's checkpoint goes through DCP, else torch.save into a new file, renamed)\n"
        "plain async: a thread torch.save-ing a host copy on rank 0 (dcp.async_save on fsdp), and the step\n"
        "extra/load: (resumed - fresh start, the median over rounds) / load, the plain load in the same\n"
        "  form (dcp or torch.load); a start ends at the loop's first batch\n"
        "read@save, read@resume: the most bytes a rank read from files (rchar, and files hashed through a\n"
        "  mapping) in a save and in a resumed start; S/N: the checkpoint's bytes over the ranks\n"
        "goals: save/same <= 1.2; async+step <= 1.2 x step; extra/load <= 1.1"
    )
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0
