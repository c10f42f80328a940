"""``ddpkit bench engine``: torch's DistributedDataParallel against ddpkit's native engine.

The engines (``engine_rounds``) take turns on every rank, in rounds. Ratios are medians of
per-round ratios, so load that drifts between rounds on a shared machine cancels out. Peak RSS
comes from separate short runs, one per engine (a process's peak covers all it ever held).
``--threads`` overrides ddpkit's one-share-of-the-cores per process: ``--threads 2`` with 2
processes on 2 cores is what a tutorial script started with mp.spawn runs (torch's default).
The arithmetic and the targets are in ``engine_summary``. ``--link RATE`` runs the engines on
emulated hosts joined by links capped at RATE, one process per host (``engine_link``).
"""

from __future__ import annotations

import argparse
import json
import resource
from dataclasses import asdict
from pathlib import Path

import torch

from ddpkit.bench import engine_link
from ddpkit.bench.engine_rounds import (
    DEFAULT_ENGINES,
    ENGINES,
    LINK_ENGINES,
    EngineBenchConfig,
    measure,
    setup_engines,
    train_step,
)
from ddpkit.bench.engine_summary import format_layouts, format_table, format_targets, summarize
from ddpkit.dist import cpu_cores, destroy, init_distributed
from ddpkit.errors import OneLineParser
from ddpkit.launch import launch
from ddpkit.launch.torchrun_flags import resolve_nproc

_FLAGS = ("blocks", "steps_per_block", "warmup", "batch", "seq", "n_layer", "n_embd", "n_head", "threads")
_HELP = {"threads": "intra-op threads per process; default 0: cores // nproc, as ddpkit sets them"}


def _timed_rank(cfg: EngineBenchConfig) -> dict:
    env = init_distributed("gloo")
    try:
        return measure(cfg, env.rank, env.world_size)
    finally:
        destroy()


def _memory_rank(cfg: EngineBenchConfig, name: str) -> float:
    env = init_distributed("gloo")
    try:
        _, models, optims, x, y = setup_engines(cfg, env.rank, (name,))
        for _ in range(cfg.warmup + 2):
            train_step(models[name], optims[name], x, y)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    finally:
        destroy()


def parser() -> argparse.ArgumentParser:
    """The ``ddpkit bench engine`` command line."""
    p = OneLineParser(prog="ddpkit bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", default="2", help="processes (default 2)")
    names = ", ".join(ENGINES)
    patterns = "native@NMB, native+powersgd:RANK[:START_ITER]"
    p.add_argument("--engines", help=f"comma-separated, from {names}, {patterns} (default {DEFAULT_ENGINES})")
    for name in _FLAGS:
        default = getattr(EngineBenchConfig(), name)
        text = _HELP.get(name, f"default {default}")
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=text)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs")
    p.add_argument(
        "--link",
        help="run on --hosts emulated hosts whose links are capped at this rate "
        "(tc's units: 300mbit, 1gbit; needs root); the engines default to " + LINK_ENGINES,
    )
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts for --link, one process each")
    p.add_argument("--json", type=Path, help="write the summary to this file")
    return p


def config_from_args(ns: argparse.Namespace) -> EngineBenchConfig:
    """The benchmark configuration the parsed flags describe."""
    default = LINK_ENGINES if getattr(ns, "link", None) else DEFAULT_ENGINES
    engines = tuple(e.strip() for e in (ns.engines or default).split(",") if e.strip())
    return EngineBenchConfig(engines=engines, **{name: getattr(ns, name) for name in _FLAGS})


def main(argv: list[str]) -> int:
    """``ddpkit bench engine``: prints the table (and writes --json); 0 on success."""
    ns = parser().parse_args(argv)
    cfg = config_from_args(ns)
    if ns.link:
        return engine_link.main(ns, cfg)
    nproc = resolve_nproc(ns.nproc)
    timed = launch(_timed_rank, nproc, (cfg,))[0]
    memory = [] if ns.no_memory else [name for name in cfg.engines if name != "solo"]
    rss = {name: launch(_memory_rank, nproc, (cfg, name)) for name in memory}
    about = {"config": asdict(cfg), "cpu_cores": cpu_cores(), "torch": torch.__version__}
    summary = summarize(timed, rss) | about
    print(
        f"# ddpkit bench engine: GPT {summary['params'] / 1e6:.1f}M params, {nproc} processes x "
        f"{summary['threads_per_rank']} threads, {cfg.blocks} rounds x {cfg.steps_per_block} steps "
        "per engine; /torch and scaling are medians of per-round ratios"
    )
    print("\n".join(filter(None, (format_table(summary), format_layouts(summary)))))
    print(format_targets(summary["targets"]))
    if ns.json:
        ns.json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0
