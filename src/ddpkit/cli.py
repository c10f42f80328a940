"""The ``ddpkit`` command: ``train``, ``run``, ``check``, ``bench``, ``report``, ``inspect``.

Errors a user can cause print as one line on stderr with exit code 2; a failed worker prints the
rank and its traceback with exit code 1; a signal that stops the launcher (SIGTERM, Ctrl-C,
--preempt-signal) exits with 128 + the signal after one line saying what became of the workers.
"""

from __future__ import annotations

import importlib
import sys

from ddpkit.errors import ConfigError
from ddpkit.launch.elastic import run_elastic
from ddpkit.launch.failures import WorkerFailure
from ddpkit.launch.stopping import Stopped
from ddpkit.launch.torchrun_flags import check_script, run_parser
from ddpkit.launch.uncaught import install_excepthook
from ddpkit.version import __version__

USAGE = """usage: ddpkit COMMAND [ARGS]

commands:
  train [TASK]       train a built-in workload (gpt, convnet, toy) or your task.py on every process
  run SCRIPT         launch a script on every process, exactly like torchrun
  check SCRIPT       the same run on 1, 2, 3 processes? a few steps of your script, compared
  bench KIND         benchmarks: engine, comm, scaling, trainer, fsdp, dropout, data
  report OUT         summarize a run and plot OUT/report.png
  inspect PATH       show and verify what a checkpoint holds

ddpkit COMMAND --help shows the flags of a command."""


def cmd_run(argv: list[str]) -> int:
    parser = run_parser()
    if not argv:
        parser.print_help()
        return 2
    ns = parser.parse_args(argv)
    check_script(ns)
    run_elastic(ns, collective_timeout=ns.collective_timeout)
    return 0


# Each benchmark is a module of ddpkit.bench with main(argv) -> exit code, imported on demand.
BENCHMARKS = {
    "engine": "ddpkit.bench.engine_bench",
    "comm": "ddpkit.bench.comm",
    "scaling": "ddpkit.bench.scaling",
    "trainer": "ddpkit.bench.trainer_bench",
    "fsdp": "ddpkit.bench.fsdp_bench",
    "dropout": "ddpkit.bench.dropout_bench",
    "data": "ddpkit.bench.data_bench",
    "setup-memory": "ddpkit.bench.setup_memory",
    "checkpoint": "ddpkit.bench.checkpoint_bench",
    "bitwise": "ddpkit.bench.bitwise_bench",
}


def cmd_train(argv: list[str]) -> int:
    from ddpkit.train.command import cmd_train as train

    return train(argv)


def cmd_bench(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: ddpkit bench {{{','.join(BENCHMARKS)}}} [--help | FLAGS]")
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        got = argv[0] if argv else "nothing"
        raise ConfigError(f"ddpkit bench needs one of {', '.join(BENCHMARKS)}, got {got!r}")
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return module.main(argv[1:])


def cmd_check(argv: list[str]) -> int:
    from ddpkit.check.command import main as check_main

    return check_main(argv)


def cmd_report(argv: list[str]) -> int:
    from ddpkit.train.report import main as report_main

    return report_main(argv)


def cmd_inspect(argv: list[str]) -> int:
    from ddpkit.checkpoint.inspect import main as inspect_main

    return inspect_main(argv)


COMMANDS = {
    "train": cmd_train,
    "run": cmd_run,
    "check": cmd_check,
    "bench": cmd_bench,
    "report": cmd_report,
    "inspect": cmd_inspect,
}


def main(argv: list[str] | None = None) -> int:
    install_excepthook()  # what escapes a command ends as ddpkit.launch.uncaught says
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
    except Stopped as exc:  # a signal to the launcher: its one line is printed already
        return exc.code
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
