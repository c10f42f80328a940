"""``ddpkit check --nproc 1,2,3 --steps K SCRIPT [ARGS...]``: the same run on every process count?

Its own flags come before the script, as torchrun's do: everything after the script is the
script's.

Each process count runs the script for K steps under ``ddpkit run`` (worker.py), one after the
other, and once more on one process with one CPU thread instead of the default (its sums cut
otherwise: the noise floor of floating point, which no parallel run can beat). For each step the
table holds the global loss's relative difference from one process, and the weights' largest
difference relative to the largest weight; a process count is the same run when both stay within
``factor`` times the floor, or within ``tolerance``. Exit code 0 when every count is the same
run, 1 when one is not (naming the first step, the parameter and what rank 0 said of the
habits that break it), 2 when a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpkit.errors import ConfigError, OneLineParser

WORKER = Path(__file__).with_name("worker.py")
SAID = ("WARNING ddpkit.run", "drops out in")  # rank 0's lines about habits (first_step.py)


@dataclass
class Trial:
    """One launch of the script: its process count, threads, and what it left behind."""

    name: str
    nproc: int
    threads: int | None = None
    losses: list[float] | None = None
    weights: dict[int, dict[str, torch.Tensor]] | None = None
    said: list[str] | None = None


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="ddpkit check", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", default="1,2", help="process counts to compare, one of them 1 (default 1,2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps each run takes (default 3)")
    p.add_argument("--tolerance", type=float, default=1e-6, help="same run below this (default 1e-6)")
    p.add_argument("--factor", type=float, default=10.0, help="same run within this times the floor")
    p.add_argument("--keep", default=None, help="keep the runs' folders and logs here")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def counts(text: str) -> list[int]:
    """``1,2,3`` as [1, 2, 3]; 1 is always among them (the reference)."""
    try:
        found = sorted({int(n) for n in text.split(",") if n.strip()} | {1})
    except ValueError:
        raise ConfigError(
            f"--nproc {text!r}: give process counts separated by commas, e.g. --nproc 1,2,3"
        ) from None
    if found[0] < 1:
        raise ConfigError(f"--nproc {text!r}: process counts start at 1")
    return found


def launch(trial: Trial, ns: argparse.Namespace, root: Path) -> None:
    """Run the script as ``trial`` says; read its losses, weights and rank 0's lines."""
    out, record, log = root / trial.name, root / f"{trial.name}.pt", root / f"{trial.name}.log"
    launcher = [sys.executable, "-m", "ddpkit", "run", "--standalone", "--nproc", str(trial.nproc)]
    worker = [str(WORKER), "--record", str(record), "--out", str(out), "--steps", str(ns.steps)]
    command = [*launcher, *worker, ns.script, *ns.args]
    env = dict(os.environ)
    if trial.threads is not None:
        env["OMP_NUM_THREADS"] = str(trial.threads)
    with open(log, "w") as sink:
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env).returncode
    text = log.read_text()
    if code != 0 or not record.exists():
        tail = "\n".join(text.splitlines()[-20:])
        raise RuntimeError(f"the run on {trial.nproc} process(es) failed (exit {code}):\n{tail}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trial.losses = [r["loss"] for r in lines if "loss" in r]
    trial.weights = torch.load(record, weights_only=True)
    trial.said = list(
        dict.fromkeys(line.strip() for line in text.splitlines() if any(s in line for s in SAID))
    )


def loss_gap(a: Trial, b: Trial, step: int) -> float:
    x, y = a.losses[step - 1], b.losses[step - 1]
    return abs(x - y) / max(abs(x), 1e-12)


def weight_gap(a: Trial, b: Trial, step: int) -> tuple[float, str]:
    """The largest difference of a weight after ``step``, relative to the largest weight of ``a``
    (fp32 rounds a weight to about 6e-8 of its size); and the parameter it is in."""
    now, other = a.weights[step], b.weights[step]
    scale = max(t.abs().max().item() for t in now.values()) or 1e-12
    worst = max(now, key=lambda k: (now[k] - other[k]).abs().max().item())
    return (now[worst] - other[worst]).abs().max().item() / scale, worst


def compare(ref: Trial, floor: Trial | None, others: list[Trial], ns: argparse.Namespace) -> int:
    """Print the table and the verdict; 0: every count is the same run, 1: not."""
    steps = min([len(ref.losses), len(ref.weights) - 1] + [len(t.losses) for t in others])
    heads = "".join(f"  {t.nproc} processes (loss, weights)" for t in others)
    print(f"step  loss (1 process){heads}  floor (loss, weights)")
    broken: list[str] = []
    for step in range(1, steps + 1):
        limit_loss = max(ns.tolerance, ns.factor * (loss_gap(ref, floor, step) if floor else 0.0))
        limit_weights = max(ns.tolerance, ns.factor * (weight_gap(ref, floor, step)[0] if floor else 0.0))
        cells = []
        for trial in others:
            (gap_w, where), gap_l = weight_gap(ref, trial, step), loss_gap(ref, trial, step)
            mark = "" if gap_l <= limit_loss and gap_w <= limit_weights else " !"
            cells.append(f"  {gap_l:>9.2e} {gap_w:>9.2e}{mark}")
            if (gap_l > limit_loss or gap_w > limit_weights) and not broken:
                what = f"loss {gap_l:.2e}" if gap_l > limit_loss else f"weights {gap_w:.2e} in {where}"
                broken = [f"{trial.nproc} processes at step {step}: {what}"]
        floors = (
            f"  {loss_gap(ref, floor, step):>9.2e} {weight_gap(ref, floor, step)[0]:>9.2e}" if floor else ""
        )
        print(f"{step:>4}  {ref.losses[step - 1]:>15.6f}{''.join(cells)}{floors}")
    if not broken:
        print(f"ddpkit check: the same run on {', '.join(str(t.nproc) for t in [ref, *others])} processes")
        return 0
    print(f"ddpkit check: not the same run: {broken[0]} (floor x{ns.factor:g} or {ns.tolerance:g})")
    said = list(dict.fromkeys(line for t in others for line in t.said))
    for line in said:
        print(f"  the run said: {line}")
    if not said:
        print("  the run named no habit that breaks it; run with --keep DIR and compare the logs")
    return 1


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    if not Path(ns.script).is_file():
        raise ConfigError(f"ddpkit check: no script at {ns.script!r}")
    if ns.steps < 1:
        raise ConfigError(f"--steps {ns.steps}: check at least 1 step")
    nprocs = counts(ns.nproc)
    with tempfile.TemporaryDirectory(prefix="ddpkit-check-") as scratch:
        root = Path(ns.keep or scratch)
        root.mkdir(parents=True, exist_ok=True)
        ref = Trial("nproc1", 1)
        others = [Trial(f"nproc{n}", n) for n in nprocs[1:]]
        default = torch.get_num_threads()
        floor = Trial("floor", 1, threads=1) if default > 1 else None
        how = f"1 process with 1 CPU thread instead of {default}" if floor else "none (1 core)"
        where = ", ".join(map(str, nprocs))
        print(f"ddpkit check: {ns.script}, {ns.steps} steps on {where} process(es); floor: {how}")
        try:
            for trial in [ref, *([floor] if floor else []), *others]:
                launch(trial, ns, root)
        except RuntimeError as exc:
            print(f"ddpkit check: {exc}", file=sys.stderr)
            return 2
        return compare(ref, floor, others, ns)
