"""The environment a launch runs in: a run directory, and the variables the agent and workers see.

Set for the duration of the launch and restored afterwards, so that a launcher called in-process
(tests, notebooks) leaves its caller's environment as it found it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddpkit.dist import cpu_cores

BOOT_DIR = Path(__file__).with_name("workerboot")  # holds the workers' sitecustomize.py
REPORTS = ("hang-report.txt", "failure-report.txt")
# Variables torch's launcher sets in its own process, restored with ours.
TORCH_SETS = ("OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE")


@contextmanager
def run_directory() -> Iterator[Path]:
    """A private folder for the workers' progress and stacks; only reports outlive the launch."""
    _sweep_orphaned(Path(tempfile.gettempdir()))
    path = Path(tempfile.mkdtemp(prefix=f"ddpkit-run-{os.getpid()}-"))
    try:
        yield path
    finally:
        if any((path / name).exists() for name in REPORTS):
            for child in path.iterdir():
                if child.name not in REPORTS:
                    child.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _sweep_orphaned(tmp: Path) -> None:
    """Remove the run folders of launchers that were killed (no ``finally`` ran), unless they
    hold a report: ``ddpkit-run-PID-*`` whose PID is gone."""
    for path in tmp.glob("ddpkit-run-*-*"):
        pid = path.name.split("-")[2]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists() or not path.is_dir():
            continue
        if not any((path / name).exists() for name in REPORTS):
            shutil.rmtree(path, ignore_errors=True)


def worker_variables(run_dir: Path, nproc: int, progress_s: float) -> dict[str, str]:
    """What the agent and every worker get on top of the launcher's environment.

    Args:
        run_dir: the run directory.
        nproc: workers on this node, to share the cores among them.
        progress_s: how often workers note their collective count (0: not at all).
    """
    path = os.environ.get("PYTHONPATH")
    values = {
        "PYTHONPATH": os.pathsep.join([str(BOOT_DIR), path]) if path else str(BOOT_DIR),
        "DDPKIT_AGENT_PID": str(os.getpid()),
        "DDPKIT_RUN_DIR": str(run_dir),
        "DDPKIT_PROGRESS_S": str(progress_s),
        # torch's own opt-out of sharing the agent's store (issue 167288): the c10d handler then
        # opens none, and ddpkit's FreshWorkerStore gives each round its own.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    if "OMP_NUM_THREADS" not in os.environ:
        # Share the cores among the workers (torchrun would give each worker a single thread);
        # a user's own OMP_NUM_THREADS is left as it is.
        values["OMP_NUM_THREADS"] = str(max(1, cpu_cores() // nproc))
    return values


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``values`` inside the block, and restored after it."""
    saved = {key: os.environ.get(key) for key in (*values, *TORCH_SETS)}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
