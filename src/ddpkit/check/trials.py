"""The runs of a check and what they say: each process count's losses and weights against one
process's and against the noise floor, and, when one is not the same run, which suspect closes
the gap (suspects.py). ``compare`` is the library call behind ``ddpkit check`` (command.py),
exported as ``ddpkit.check.compare``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddpkit.check.suspects import SUSPECTS, Suspect

WORKER = Path(__file__).with_name("worker.py")
SAID = ("WARNING ddpkit.run", "drops out in")  # rank 0's lines about habits (first_step.py)


@dataclass
class Trial:
    """One launch of the script: its process count, threads, suspect off, and what it left behind."""

    name: str
    nproc: int
    threads: int | None = None
    cut: int | None = None  # one process, its batch cut into the micro-batches of this many
    suspect: str | None = None
    steps: int | None = None  # None: the check's
    losses: list[float] | None = None
    weights: dict[int, dict[str, torch.Tensor]] | None = None
    said: list[str] | None = None


@dataclass
class Row:
    """One step of the table: the reference loss, each count's (loss gap, weight gap, within
    limits), and the floor's gaps (None without a floor)."""

    step: int
    loss: float
    gaps: list[tuple[float, float, bool]]
    floor: tuple[float, float] | None


@dataclass
class Report:
    """What a check found.

    Attributes:
        nprocs: the process counts compared, 1 first.
        floor: how the noise floor was measured ("" when there is none).
        rows: one per step.
        same: every count is the same run.
        broken: where it first is not: "N processes at step K: loss 1.2e-03" ("" when same).
        said: rank 0's lines about habits that break the same update.
        causes: (suspect, the gap left with it switched off) for each suspect that closes the gap.
        tried: every suspect rerun, with the gap it left.
    """

    nprocs: list[int]
    floor: str
    rows: list[Row] = field(default_factory=list)
    same: bool = True
    broken: str = ""
    said: list[str] = field(default_factory=list)
    causes: list[tuple[Suspect, float]] = field(default_factory=list)
    tried: list[tuple[Suspect, float]] = field(default_factory=list)


class RunFailed(RuntimeError):
    """A run of the script failed: the message holds its exit code and its last lines."""


def launch(trial: Trial, script: str, args: list[str], steps: int, root: Path) -> None:
    """Run the script as ``trial`` says; read its losses, weights and rank 0's lines."""
    out, record, log = root / trial.name, root / f"{trial.name}.pt", root / f"{trial.name}.log"
    launcher = [sys.executable, "-m", "ddpkit", "run", "--standalone", "--nproc", str(trial.nproc)]
    worker = [str(WORKER), "--record", str(record), "--out", str(out), "--steps", str(trial.steps or steps)]
    if trial.suspect is not None:
        worker += ["--suspect", trial.suspect]
    if trial.cut is not None:
        worker += ["--cut", str(trial.cut)]
    env = dict(os.environ)
    if trial.threads is not None:
        env["OMP_NUM_THREADS"] = str(trial.threads)
    with open(log, "w") as sink:
        command = [*launcher, *worker, script, *args]
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env).returncode
    text = log.read_text()
    if code != 0 or not record.exists():
        tail = "\n".join(text.splitlines()[-20:])
        raise RunFailed(f"the run on {trial.nproc} process(es) failed (exit {code}):\n{tail}")
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


@dataclass(frozen=True)
class Limits:
    """Same run: both gaps within ``factor`` times the floor's, or within ``tolerance``."""

    tolerance: float = 1e-6
    factor: float = 10.0

    def of(self, ref: Trial, floor: Trial | None, step: int) -> tuple[float, float]:
        """The (loss, weights) limits at ``step``."""
        if floor is None:
            return self.tolerance, self.tolerance
        loose = self.factor * loss_gap(ref, floor, step), self.factor * weight_gap(ref, floor, step)[0]
        return max(self.tolerance, loose[0]), max(self.tolerance, loose[1])


def table(ref: Trial, floor: Trial | None, others: list[Trial], limits: Limits, report: Report) -> int:
    """Fill the report's rows and its first break; the first broken step (0: none)."""
    steps = min([len(ref.losses), len(ref.weights) - 1] + [len(t.losses) for t in others])
    first = 0
    for step in range(1, steps + 1):
        limit_loss, limit_weights = limits.of(ref, floor, step)
        gaps = []
        for trial in others:
            (gap_w, where), gap_l = weight_gap(ref, trial, step), loss_gap(ref, trial, step)
            within = gap_l <= limit_loss and gap_w <= limit_weights
            gaps.append((gap_l, gap_w, within))
            if not within and not first:
                what = f"loss {gap_l:.2e}" if gap_l > limit_loss else f"weights {gap_w:.2e} in {where}"
                report.broken, first = f"{trial.nproc} processes at step {step}: {what}", step
        floors = (loss_gap(ref, floor, step), weight_gap(ref, floor, step)[0]) if floor else None
        report.rows.append(Row(step, ref.losses[step - 1], gaps, floors))
    return first


def find_causes(
    script: str,
    args: list[str],
    nproc: int,
    step: int,
    limit: tuple[float, float],
    root: Path,
    report: Report,
) -> None:
    """Rerun the first ``step`` steps on 1 and ``nproc`` processes with each suspect switched off;
    a suspect whose rerun is within ``limit`` (loss, weights) at ``step`` closes the gap. The
    suspects rank 0 saw (their ``seen`` line) go first; the others only when none of those closes
    it (rank 0's line about the loop's draws can miss some)."""
    seen = [s for s in SUSPECTS if s.seen is not None and any(s.seen in line for line in report.said)]
    for round_ in (seen, [s for s in SUSPECTS if s.seen is None]):
        for suspect in round_:
            pair = [Trial(f"{suspect.name}-{n}", n, suspect=suspect.name, steps=step) for n in (1, nproc)]
            for trial in pair:
                launch(trial, script, args, step, root)
            gaps = loss_gap(pair[0], pair[1], step), weight_gap(pair[0], pair[1], step)[0]
            report.tried.append((suspect, max(gaps)))
            if gaps[0] <= limit[0] and gaps[1] <= limit[1]:
                report.causes.append((suspect, max(gaps)))
        if report.causes:
            return


def floor_trial(how: str, counts: list[int]) -> tuple[Trial | None, str]:
    """The run the floor is measured on, and its description: ``threads`` (one process with 1 CPU
    thread instead of its default), ``micro`` (one process, its batch cut into the micro-batches
    of the largest count: a GPU's, whose sums do not follow the thread count), or ``auto``
    (micro on a GPU, threads on a CPU)."""
    if how == "auto":
        how = "micro" if torch.cuda.is_available() else "threads"
    if how == "micro":
        return Trial("floor", 1, cut=counts[-1]), f"1 process, its batch cut as {counts[-1]} processes cut it"
    default = torch.get_num_threads()
    if default < 2:
        return None, ""
    return Trial("floor", 1, threads=1), f"1 process with 1 CPU thread instead of {default}"


def compare(
    script: str | Path,
    args: list[str] | tuple[str, ...] = (),
    nprocs: tuple[int, ...] = (1, 2),
    steps: int = 3,
    limits: Limits = Limits(),
    keep: str | Path | None = None,
    floor: str = "auto",
) -> Report:
    """Run ``script ARGS`` for ``steps`` steps on each process count (1 always among them) and on
    the noise floor (``floor_trial``), compare them, and name the suspects that close a gap.
    Raises ``RunFailed`` when a run of the script fails."""
    script, args, counts = str(script), list(args), sorted(set(nprocs) | {1})
    base, how = floor_trial(floor, counts)
    report = Report(counts, how)
    with tempfile.TemporaryDirectory(prefix="ddpkit-check-") as scratch:
        root = Path(keep or scratch)
        root.mkdir(parents=True, exist_ok=True)
        ref = Trial("nproc1", 1)
        others = [Trial(f"nproc{n}", n) for n in counts[1:]]
        for trial in [ref, *([base] if base else []), *others]:
            launch(trial, script, args, steps, root)
        first = table(ref, base, others, limits, report)
        report.said = list(dict.fromkeys(line for t in others for line in t.said))
        if first:
            report.same = False
            worst = next(t for t in others if report.broken.startswith(f"{t.nproc} processes"))
            limit = limits.of(ref, base, first)
            find_causes(script, args, worst.nproc, first, limit, root, report)
    return report
