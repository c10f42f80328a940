"""The ``ddpkit`` command: ``train`` and ``run``.

Errors a user can cause print as one line on stderr with exit code 2; a failed worker prints the
rank and its traceback with exit code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import shutil
import sys
from pathlib import Path

import torch.distributed.run as torchrun

from ddpkit.checkpoint.lock import check_not_running
from ddpkit.dist import resolve_backend
from ddpkit.errors import ConfigError, OneLineParser
from ddpkit.launch.elastic import (
    add_launch_flags,
    check_launch_args,
    check_script,
    nnodes_range,
    resolve_nproc,
    run_elastic,
    run_parser,
    torchrun_argv,
)
from ddpkit.launch.failures import WorkerFailure
from ddpkit.train.config import TrainConfig, check_same_run, check_split
from ddpkit.train.workloads import WORKLOADS, with_defaults
from ddpkit.version import __version__

USAGE = """usage: ddpkit COMMAND [ARGS]

commands:
  train [WORKLOAD]   train a built-in workload (gpt, convnet, toy) on every process
  run SCRIPT         launch a script on every process, exactly like torchrun
  bench KIND         benchmarks: engine, comm, scaling, trainer
  report OUT         summarize a run and plot OUT/report.png
  inspect PATH       show and verify what a checkpoint holds

ddpkit COMMAND --help shows the flags of a command."""


def train_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="ddpkit train", description="Train a built-in workload data-parallel.")
    parser.add_argument("workload", nargs="?", default="gpt", help=f"one of {', '.join(WORKLOADS)}")
    parser.add_argument("--steps", type=int, help="optimizer steps (workload default when unset)")
    parser.add_argument("--global-batch", type=int, help="samples per step over all processes")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, help="linear warmup steps before cosine decay")
    parser.add_argument("--seed", type=int, default=0, help="seed for init, data order and sampling")
    parser.add_argument("--out", help="output directory (default runs/WORKLOAD)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    parser.add_argument("--log-every", type=int, default=10, help="steps between metrics lines")
    parser.add_argument("--backend", default="auto", help="auto, gloo, nccl or mpi")
    parser.add_argument(
        "--engine", default="torch", help="torch (DistributedDataParallel) or native (ddpkit.DataParallel)"
    )
    parser.add_argument("--data", help="a UTF-8 text file (gpt) or an MNIST IDX directory (convnet)")
    parser.add_argument(
        "--micro-batch", type=int, help="samples per forward/backward; accumulates under no_sync"
    )
    parser.add_argument("--epochs", type=int, help="passes over the data (instead of --steps)")
    parser.add_argument("--precision", default="fp32", help="fp32, bf16, or fp16 (GPU)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm; 0 disables")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    parser.add_argument(
        "--resume", default="never", help="never, auto (newest good checkpoint in --out) or PATH"
    )
    parser.add_argument(
        "--eval-every", type=int, default=0, help="evaluate on the held-out split every N steps"
    )
    parser.add_argument("--log-samples", action="store_true", help="log each rank's dataset indices per step")
    parser.add_argument(
        "--drop-last", action="store_true", help="skip each epoch's final partial global batch"
    )
    parser.add_argument(
        "--check-every", type=int, default=100, help="compare replica fingerprints every N steps"
    )
    parser.add_argument("--on-nonfinite", default="stop", help="stop or skip on a non-finite gradient")
    parser.add_argument(
        "--rank-table-every", type=int, default=0, help="log every rank's timings every N steps"
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=1800.0,
        help="seconds without progress before a hang report (0: off)",
    )
    add_launch_flags(parser)
    return parser


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """Map the parsed flags onto TrainConfig by name; the workload fills what is left unset."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {name: value for name, value in vars(ns).items() if name in names}
    values["out"] = ns.out or f"runs/{ns.workload}"
    return with_defaults(TrainConfig(**values))


def prepare_out(cfg: TrainConfig, overwrite: bool) -> None:
    """Make ``cfg.out`` ready; never delete anything that is not a ddpkit run, never resume another run."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file, not a directory; choose another --out")
    saved = out / "config.json"
    if out.is_dir() and any(out.iterdir()):
        if cfg.resume != "never" and not overwrite:
            if saved.is_file():
                check_same_run(TrainConfig.from_json(saved.read_text(encoding="utf-8")), cfg)
            return
        if just_prepared(out, cfg):
            return
        if not overwrite:
            raise ConfigError(
                f"--out {str(out)!r} already holds a run; pass --resume auto to continue it, "
                "--overwrite to replace it, or choose another --out"
            )
        if not saved.is_file():
            raise ConfigError(
                f"--out {str(out)!r} holds files that are not a ddpkit run; "
                "--overwrite only replaces ddpkit runs, so choose another --out"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def just_prepared(out: Path, cfg: TrainConfig) -> bool:
    """True when another node of this job prepared the shared --out a moment ago (c10d gives
    every node node_rank 0): the same config, and nothing trained yet."""
    saved = out / "config.json"
    started = (out / "metrics.jsonl").exists() or (out / "checkpoints").exists()
    return saved.is_file() and saved.read_text(encoding="utf-8") == cfg.to_json() and not started


def cmd_train(argv: list[str]) -> int:
    ns = train_parser().parse_args(argv)
    cfg = config_from_args(ns)
    torch_ns = torchrun.get_args_parser().parse_args(
        torchrun_argv(ns) + ["-m", "ddpkit.train.worker", "CONFIG"]
    )
    nproc = resolve_nproc(str(ns.nproc))
    resolve_backend(cfg.backend, nproc)
    low, high = nnodes_range(ns.nnodes)
    for nodes in range(low, high + 1):
        check_split(cfg.global_batch, nodes * nproc)
    check_launch_args(torch_ns)
    out = Path(cfg.out)
    if high == 1:  # one node: refuse a folder a live run holds before anything is written or deleted
        check_not_running(out)
    if ns.node_rank == 0:
        prepare_out(cfg, ns.overwrite)
        (out / "config.json").write_text(cfg.to_json(), encoding="utf-8")
    torch_ns.training_script_args = [str(out / "config.json")]
    run_elastic(torch_ns)
    return 0


def cmd_run(argv: list[str]) -> int:
    parser = run_parser()
    if not argv:
        parser.print_help()
        return 2
    ns = parser.parse_args(argv)
    check_script(ns)
    run_elastic(ns, collective_timeout=ns.collective_timeout)
    return 0


BENCHMARKS = ("engine", "comm", "scaling", "trainer")


def cmd_bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        got = argv[0] if argv else "nothing"
        raise ConfigError(f"ddpkit bench needs one of {', '.join(BENCHMARKS)}, got {got!r}")
    # Each benchmark lives in ddpkit/bench/KIND.py with main(argv) -> exit code; imported on demand.
    module = importlib.import_module(f"ddpkit.bench.{argv[0]}")
    return module.main(argv[1:])


def cmd_report(argv: list[str]) -> int:
    from ddpkit.train.report import main as report_main

    return report_main(argv)


def cmd_inspect(argv: list[str]) -> int:
    from ddpkit.checkpoint.inspect import main as inspect_main

    return inspect_main(argv)


COMMANDS = {
    "train": cmd_train,
    "run": cmd_run,
    "bench": cmd_bench,
    "report": cmd_report,
    "inspect": cmd_inspect,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"ddpkit {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise ConfigError(f"unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}")
        return command(argv[1:])
    except ConfigError as exc:
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return 2
    except WorkerFailure as exc:
        print(f"ddpkit: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
