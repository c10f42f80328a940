"""``ddpkit check --nproc 1,2,3 --steps K SCRIPT [ARGS...]``: the same run on every process count?

Its own flags come before the script, as torchrun's do: everything after the script is the
script's.

Each process count runs the script for K steps under ``ddpkit run`` (worker.py), one after the
other, and once more on one process with its sums cut otherwise: the noise floor of floating
point, which no parallel run can beat (``--floor``: one CPU thread instead of the default, or on a
GPU the batch cut into the micro-batches of the largest process count). For each step the
table holds the global loss's relative difference from one process, and the weights' largest
difference relative to the largest weight; a process count is the same run when both stay within
``factor`` times the floor, or within ``tolerance``. When one is not, the steps up to the first
broken one run again with each suspect habit switched off (suspects.py: dropout, BatchNorm, the
loop's global draws), and the verdict names those that close the gap with the fix for each.
Exit code 0 when every count is the same run, 1 when one is not, 2 when a run fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddpkit.check.trials import Limits, Report, RunFailed, compare, floor_trial
from ddpkit.errors import ConfigError, OneLineParser


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="ddpkit check", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", default="1,2", help="process counts to compare, one of them 1 (default 1,2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps each run takes (default 3)")
    p.add_argument("--tolerance", type=float, default=1e-6, help="same run below this (default 1e-6)")
    p.add_argument("--factor", type=float, default=10.0, help="same run within this times the floor")
    p.add_argument(
        "--floor",
        choices=("auto", "threads", "micro"),
        default="auto",
        help="the noise floor: 1 CPU thread (threads), the batch cut as N processes cut it (micro), "
        "or micro on a GPU and threads on a CPU (auto, the default)",
    )
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


def show(report: Report, limits: Limits) -> None:
    """The table, one row a step, and the verdict with its causes."""
    heads = "".join(f"  {n} processes (loss, weights)" for n in report.nprocs[1:])
    print(f"step  loss (1 process){heads}  floor (loss, weights)")
    for row in report.rows:
        cells = "".join(f"  {gl:>9.2e} {gw:>9.2e}{'' if ok else ' !'}" for gl, gw, ok in row.gaps)
        floors = f"  {row.floor[0]:>9.2e} {row.floor[1]:>9.2e}" if row.floor else ""
        print(f"{row.step:>4}  {row.loss:>15.6f}{cells}{floors}")
    if report.same:
        print(f"ddpkit check: the same run on {', '.join(map(str, report.nprocs))} processes")
        return
    print(
        f"ddpkit check: not the same run: {report.broken} (floor x{limits.factor:g} or {limits.tolerance:g})"
    )
    for suspect, left in report.causes:
        print(f"  the cause: {suspect.what}; switched off, the gap is {left:.1e}. Fix: {suspect.fix}")
    if not report.causes:
        tried = ", ".join(f"{s.name} {left:.1e}" for s, left in report.tried)
        print(f"  no one suspect closes the gap (switched off, each left: {tried}); run with --keep DIR")
    for line in report.said:
        print(f"  the run said: {line}")


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    if not Path(ns.script).is_file():
        raise ConfigError(f"ddpkit check: no script at {ns.script!r}")
    if ns.steps < 1:
        raise ConfigError(f"--steps {ns.steps}: check at least 1 step")
    nprocs = counts(ns.nproc)
    limits = Limits(ns.tolerance, ns.factor)
    floor = floor_trial(ns.floor, nprocs)[1] or "none (1 core)"
    where = ", ".join(map(str, nprocs))
    print(f"ddpkit check: {ns.script}, {ns.steps} steps on {where} process(es); floor: {floor}", flush=True)
    try:
        report = compare(ns.script, ns.args, tuple(nprocs), ns.steps, limits, ns.keep, ns.floor)
    except RunFailed as exc:
        print(f"ddpkit check: {exc}", file=sys.stderr)
        return 2
    show(report, limits)
    return 0 if report.same else 1
