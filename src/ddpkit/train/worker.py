"""The entry point each training process runs: ``python -m ddpkit.train.worker OUT/config.json``.

``ddpkit train`` starts it through torchrun's elastic agent; ``@record`` writes a failing rank's
traceback where the agent finds it, so the launcher can say which rank failed and why. The path
from here: config.json -> ddpkit.Run (process group, seeds, lock, resume point) -> the task's
build(cfg) -> Trainer (run.setup, run.loader, run.track) -> fit -> run.finish.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from ddpkit.diagnostics.consistency import check_same_config
from ddpkit.dist import DistEnv, read_launcher_vars
from ddpkit.errors import ConfigError
from ddpkit.launch.orphans import die_with_parent
from ddpkit.launch.uncaught import install_excepthook
from ddpkit.run import Run
from ddpkit.train.job import JobConfig
from ddpkit.train.task import Task, build_task, is_task_spec
from ddpkit.train.trainer import Trainer
from ddpkit.train.workloads import get_workload

USER_ERROR = 2  # the exit code of a worker stopped by a ConfigError; it printed the one line


def train(cfg: JobConfig) -> None:
    """Join the run, build the task (every rank seeded alike), train and finish."""
    options = cfg.run_options()
    if options["resume"] == "never" and has_checkpoints(Path(cfg.run.out)):
        # The launcher made sure --out held no other run when the job began, so checkpoints found
        # now are this job's own: a membership change restarted the workers (which the elastic
        # agent does not count as a restart). Continue from the newest good one.
        options["resume"] = "auto"
    run = Run(**options)
    try:
        check_same_job(cfg, run.env)
        trainer = Trainer(run, build(cfg), cfg.train)
    except BaseException:
        run.close()  # leave the group and the folder's lock without a collective
        raise
    trainer.fit()


def check_same_job(cfg: JobConfig, env: DistEnv) -> None:
    """Every rank runs the same config (nodes may differ in where they write and how they start)."""
    check_same_config(cfg.replace(out="-", resume="auto").to_json(), env)


def build(cfg: JobConfig) -> Task:
    """The task ``cfg.train.task`` names: a built-in workload, a task file or module:function."""
    spec = cfg.train.task
    return build_task(spec, cfg) if is_task_spec(spec) else get_workload(spec).build(cfg)


def has_checkpoints(out: Path) -> bool:
    folder = out / "checkpoints"
    return folder.is_dir() and any(folder.glob("step-*"))


@record
def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    install_excepthook()
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0])
    try:
        train(JobConfig.from_json(path.read_text(encoding="utf-8"), where=str(path)))
    except ConfigError as exc:
        # A user's mistake (a task file that returns no Task, a checkpoint of another model):
        # one line from rank 0, and exit code 2, which the launcher passes on without a report.
        if read_launcher_vars().rank == 0:
            print(f"ddpkit: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR) from None


if __name__ == "__main__":
    main()
