"""The ``ddpkit`` command: ``train`` and ``run``.

Errors a user can cause print as one line on stderr with exit code 2; a failed worker prints the
rank and its traceback with exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
from pathlib import Path

import torch.distributed.run as torchrun

from ddpkit import __version__
from ddpkit.dist import resolve_backend
from ddpkit.errors import ConfigError
from ddpkit.launch.elastic import (
    add_launch_flags,
    check_launch_args,
    check_script,
    nnodes_range,
    run_elastic,
    run_parser,
    torchrun_argv,
)
from ddpkit.launch.failures import WorkerFailure
from ddpkit.train.config import TrainConfig, check_split
from ddpkit.train.workloads import WORKLOADS, with_defaults

USAGE = """usage: ddpkit COMMAND [ARGS]

commands:
  train [WORKLOAD]   train a built-in workload (gpt, convnet, toy) on every process
  run SCRIPT         launch a script on every process, exactly like torchrun
  bench KIND         benchmarks: engine, comm, scaling

ddpkit COMMAND --help shows the flags of a command."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (exit code 2), like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see {self.prog} --help")


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
        "--engine", default="torch", help="gradient sync engine: torch (DistributedDataParallel)"
    )
    parser.add_argument("--data", help="a UTF-8 text file (gpt) or an MNIST IDX directory (convnet)")
    add_launch_flags(parser)
    return parser


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    cfg = TrainConfig(
        workload=ns.workload,
        steps=ns.steps,
        global_batch=ns.global_batch,
        lr=ns.lr,
        warmup_steps=ns.warmup_steps,
        seed=ns.seed,
        out=ns.out or f"runs/{ns.workload}",
        log_every=ns.log_every,
        backend=ns.backend,
        engine=ns.engine,
        data=ns.data,
    )
    return with_defaults(cfg)


def prepare_out(out: Path, overwrite: bool) -> None:
    """Make ``out`` empty and ready; never delete anything that is not a ddpkit run."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file, not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"--out {str(out)!r} already holds a run; pass --overwrite to replace it, "
                "or choose another --out"
            )
        if not (out / "config.json").is_file():
            raise ConfigError(
                f"--out {str(out)!r} holds files that are not a ddpkit run; "
                "--overwrite only replaces ddpkit runs, so choose another --out"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def cmd_train(argv: list[str]) -> int:
    ns = train_parser().parse_args(argv)
    cfg = config_from_args(ns)
    torch_ns = torchrun.get_args_parser().parse_args(
        torchrun_argv(ns) + ["-m", "ddpkit.train.worker", "CONFIG"]
    )
    check_launch_args(torch_ns)
    nproc = int(torch_ns.nproc_per_node)
    resolve_backend(cfg.backend, nproc)
    low, high = nnodes_range(ns.nnodes)
    for nodes in range(low, high + 1):
        check_split(cfg.global_batch, nodes * nproc)
    out = Path(cfg.out)
    if ns.node_rank == 0:
        prepare_out(out, ns.overwrite)
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
    run_elastic(ns)
    return 0


BENCHMARKS = ("engine", "comm", "scaling")


def cmd_bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        got = argv[0] if argv else "nothing"
        raise ConfigError(f"ddpkit bench needs one of {', '.join(BENCHMARKS)}, got {got!r}")
    # Each benchmark lives in ddpkit/bench/KIND.py with main(argv) -> exit code; imported on demand.
    module = importlib.import_module(f"ddpkit.bench.{argv[0]}")
    return module.main(argv[1:])


COMMANDS = {"train": cmd_train, "run": cmd_run, "bench": cmd_bench}


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
