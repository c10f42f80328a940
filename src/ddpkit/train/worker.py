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

from ddpkit.launch.orphans import die_with_parent
from ddpkit.run import Run
from ddpkit.train.job import JobConfig
from ddpkit.train.task import Task, build_task, is_task_spec
from ddpkit.train.trainer import Trainer
from ddpkit.train.workloads import get_workload


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
        trainer = Trainer(run, build(cfg), cfg.train)
    except BaseException:
        run.close()  # leave the group and the folder's lock without a collective
        raise
    trainer.fit()


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
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0])
    train(JobConfig.from_json(path.read_text(encoding="utf-8"), where=str(path)))


if __name__ == "__main__":
    main()
