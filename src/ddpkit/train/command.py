"""``ddpkit train [WORKLOAD | path/to/task.py | module:build] [flags] [--config run.toml]``.

The launcher side of a training job: settle the config (workload defaults, TOML, flags),
check it before any process starts, make OUT ready without losing anything that is there,
write OUT/config.json and start ``ddpkit.train.worker`` on every process through torchrun's
elastic agent.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
from pathlib import Path

from ddpkit.checkpoint.lock import check_not_running
from ddpkit.dist import resolve_backend
from ddpkit.errors import ConfigError, OneLineParser
from ddpkit.launch.elastic import run_elastic
from ddpkit.launch.failures import WorkerFailure
from ddpkit.launch.torchrun_flags import (
    add_launch_flags,
    check_launch_args,
    nnodes_range,
    resolve_nproc,
    run_parser,
    torchrun_argv,
)
from ddpkit.run.config import check_split
from ddpkit.train.flags import add_config_flags, flag_values, read_toml
from ddpkit.train.job import OWNER, JobConfig, check_same_run, layered
from ddpkit.train.task import check_task_spec, is_task_spec
from ddpkit.train.worker import USER_ERROR
from ddpkit.train.workloads import WORKLOADS, check_data, get_workload


def train_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ddpkit train",
        description="Train a built-in workload, or your own task file, data-parallel on every process.",
    )
    defaults = "; ".join(
        f"{w.name}: " + ", ".join(f"{k} {v}" for k, v in w.defaults.items()) for w in WORKLOADS.values()
    )
    parser.add_argument(
        "task",
        nargs="?",
        help=f"{', '.join(WORKLOADS)} (default gpt), path/to/task.py or package.module:build, "
        f"which returns ddpkit.Task. The workloads' own defaults: {defaults}",
    )
    parser.add_argument("--config", help="a TOML file with the same settings ([data], [engine], ...)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    add_config_flags(parser, skip=("task",))
    add_launch_flags(parser)
    return parser


def parse(argv: list[str]) -> tuple[JobConfig, argparse.Namespace]:
    """The job's config and the launch flags, from the TOML file and the command line."""
    parser = train_parser()
    config_path = parser.parse_known_args(argv)[0].config
    toml, launch = {}, {}
    if config_path:
        toml, launch = read_toml(config_path, launch_dests(parser))
        parser.set_defaults(**launch)
    ns = parser.parse_args(argv)
    task = ns.task or toml.pop("task", None) or "gpt"
    if is_task_spec(task):
        task, defaults = check_task_spec(task), {}
    else:
        work = get_workload(task)
        check_data(work, flag_values(ns).get("data", toml.get("data")))
        defaults = work.defaults
    try:
        cfg = layered(task, defaults, toml, flag_values(ns))
    except ConfigError as exc:
        raise ConfigError(as_flags(str(exc))) from None
    if cfg.data.global_batch is None:
        raise ConfigError(
            f"{task} needs a global batch: pass --global-batch N (samples per step over all processes) "
            "or set global_batch under [data] in --config"
        )
    return cfg, ns


def as_flags(message: str) -> str:
    """A config error in the command's words: ``steps=0`` becomes ``--steps 0``."""

    def flag(match: re.Match) -> str:
        name = match[1]
        return f"--{name.replace('_', '-')} " if name in OWNER else match[0]

    return re.sub(r"\b(\w+)=", flag, message)


def launch_dests(parser: argparse.ArgumentParser) -> set[str]:
    """The launcher's flags by name, as a [launch] table of --config may set them."""
    groups = [g for g in parser._action_groups if (g.title or "").startswith("launch")]
    return {action.dest for group in groups for action in group._group_actions}


def prepare_out(cfg: JobConfig, overwrite: bool) -> None:
    """Make OUT ready; never delete anything that is not a ddpkit run, never resume another run."""
    out = Path(cfg.run.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file, not a directory; choose another --out")
    saved = out / "config.json"
    if out.is_dir() and any(out.iterdir()):
        if cfg.checkpoint.resume != "never" and not overwrite:
            if saved.is_file():
                check_same_run(
                    JobConfig.from_json(saved.read_text(encoding="utf-8"), str(saved)), cfg, str(out)
                )
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


def write_config(cfg: JobConfig) -> Path:
    """OUT/config.json: what every worker reads and what a later --resume is compared with."""
    out = Path(cfg.run.out)
    path = out / "config.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(cfg.to_json(), encoding="utf-8")
        checkpoints = out / "checkpoints"
        if checkpoints.exists() and not os.access(checkpoints, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(checkpoints))
    except OSError as exc:
        raise ConfigError(
            f"--out {str(out)!r} cannot be written ({exc.strerror}: {exc.filename}); choose another --out"
        ) from None
    return path


def just_prepared(out: Path, cfg: JobConfig) -> bool:
    """True when another node of this job prepared the shared OUT a moment ago (c10d gives
    every node node_rank 0): the same config, and nothing trained yet."""
    saved = out / "config.json"
    started = (out / "metrics.jsonl").exists() or (out / "checkpoints").exists()
    return saved.is_file() and saved.read_text(encoding="utf-8") == cfg.to_json() and not started


def cmd_train(argv: list[str]) -> int:
    cfg, ns = parse(argv)
    torch_ns = run_parser().parse_args(torchrun_argv(ns) + ["-m", "ddpkit.train.worker", "CONFIG"])
    nproc = resolve_nproc(str(ns.nproc))
    resolve_backend(cfg.run.backend, nproc)
    low, high = nnodes_range(ns.nnodes)
    try:
        for nodes in range(low, high + 1):
            check_split(cfg.data.global_batch, nodes * nproc)
    except ConfigError as exc:
        raise ConfigError(as_flags(str(exc))) from None
    check_launch_args(torch_ns)
    out = Path(cfg.run.out)
    if high == 1:  # one node: refuse a folder a live run holds before anything is written or deleted
        check_not_running(out)
    if ns.node_rank == 0:
        prepare_out(cfg, ns.overwrite)
        write_config(cfg)
    torch_ns.training_script_args = [str(out / "config.json")]
    quiet = _QuietUserError()
    TORCH_PROCS_LOG.addFilter(quiet)
    try:
        run_elastic(torch_ns)
    except WorkerFailure as exc:
        if exc.exitcode == USER_ERROR:
            return 2  # the worker printed the one-line error already
        raise
    finally:
        TORCH_PROCS_LOG.removeFilter(quiet)
    return 0


TORCH_PROCS_LOG = logging.getLogger("torch.distributed.elastic.multiprocessing.api")


class _QuietUserError(logging.Filter):
    """Drops torch's "failed (exitcode: 2) ..." line: the worker said what was wrong in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        failed = isinstance(record.msg, str) and record.msg.startswith("failed (exitcode")
        return not (failed and record.args and record.args[0] == USER_ERROR)
