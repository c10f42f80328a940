"""Diagnostics for unmodified scripts under `ddpkit run`: hangs, failures, exit codes, threads.

The scripts know nothing of ddpkit; everything comes from the launcher and the start-up code it
puts on the workers' path (faulthandler, the collective count, PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from helpers import ddpkit_cli
from run_scripts import HANG_SCRIPT, ddpkit_run, workers

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def reports_in_tmp_path(tmp_path, monkeypatch):
    """The launcher's run directory (and the reports kept in it) lands in the test's folder."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _finish(proc: subprocess.Popen, limit: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"still running after {limit} s:\n{err[-3000:]}") from None
    return proc.returncode, err


def _report(err: str) -> tuple[str, Path]:
    """The launcher's last line, and the report file it names."""
    last = err.strip().splitlines()[-1]
    found = re.search(r"is in (.+)$", last)  # the path may hold a space
    assert found, err[-3000:]
    return last, Path(found.group(1))


def test_a_rank_that_never_reaches_the_collective_is_named_with_every_stack(tmp_path):
    script, ready = tmp_path / "hang.py", tmp_path / "ready"
    script.write_text(HANG_SCRIPT)
    proc = ddpkit_run("--nproc", "2", "--collective-timeout", "3", str(script), str(ready))
    code, err = _finish(proc)
    last, report = _report(err)
    assert code == 1
    assert last.startswith("ddpkit: a collective did not complete within 3 s (--collective-timeout): rank 0 ")
    assert "rank 1 has not reached it" in last
    text = report.read_text()
    assert "rank 1: issued #" in text and ", 1 behind;" in text
    rank0, rank1 = text.split("stacks of rank 1")
    assert "in backward" in rank0.split("stacks of rank 0")[1], text  # waiting for the all-reduce
    assert "in stuck_forever" in rank1, text
    assert "_watch_progress" not in text  # ddpkit's own thread is left out


def _counted(launcher: int, rank: int) -> bool:
    """True once RANK's progress record in its launcher's run folder holds a collective count."""
    tmp = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())  # the launcher's (this file sets it)
    for path in tmp.glob(f"ddpkit-run-{launcher}-*/progress-{rank}"):
        fields = path.read_text().split()  # PID SEQ WALL LEFT WORLD TIMEOUT (boot_progress.py)
        if len(fields) == 6 and int(fields[1]) >= 0:
            return True
    return False


def test_a_frozen_rank_is_named_as_stopped(tmp_path, monkeypatch):
    script, ready = tmp_path / "hang.py", tmp_path / "ready"
    script.write_text(HANG_SCRIPT)
    monkeypatch.setenv("HANG_RANK", "-1")  # nobody hangs by itself: the test freezes rank 0
    proc = ddpkit_run("--nproc", "2", "--collective-timeout", "3", str(script), str(ready))
    deadline = time.monotonic() + 90
    # Frozen once its progress thread has noted a collective: a worker started in milliseconds
    # reaches step 5 before the thread's first look, and is then reported with no count.
    while not (ready.exists() and _counted(proc.pid, rank=0)):
        if proc.poll() is not None or time.monotonic() > deadline:
            _finish(proc, limit=0.1)  # kills it, with its output in the message, if it still runs
            raise AssertionError(f"no count from rank 0 before the launcher exited ({proc.returncode})")
        time.sleep(0.05)
    os.kill(workers(proc.pid, str(script))[(0, 0)], signal.SIGSTOP)
    frozen_at = time.monotonic()
    code, err = _finish(proc)
    last, report = _report(err)
    assert code == 1 and "rank 1 waited" in last and "rank 0 has not reached it" in last, err[-3000:]
    assert time.monotonic() - frozen_at < 3 + 15
    text = report.read_text()
    assert re.search(r"rank 0: issued #\d+ when last seen .*: stopped \(SIGSTOP\)", text), text
    assert "(no stack: the process is stopped (SIGSTOP)" in text


EXIT_3 = textwrap.dedent(
    """
    import sys, time, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        sys.exit(3)  # ddpkit's watchdog exits with 3 on a hang; a script may too, for its own reasons
    # Not a barrier: rank 0 would fail in it as soon as rank 1's socket closed, and beside a busy
    # core the agent saw that first and SIGTERMed rank 1 in the middle of its exit (-15, not 3).
    time.sleep(120)
    """
)


def test_exit_code_3_is_not_taken_for_a_hang(tmp_path):
    script = tmp_path / "exit3.py"
    script.write_text(EXIT_3)
    code, err = _finish(ddpkit_run("--nproc", "2", str(script)))
    assert code == 1 and "hang" not in err and "did not complete" not in err
    assert "\nddpkit: rank 1 failed (exit code 3): see the worker's output above for its traceback\n" in err


FAILS_WHILE_OTHERS_WAIT = textwrap.dedent(
    """
    import time, torch.distributed as dist

    def waiting_for_the_others():
        time.sleep(120)

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(1)
        raise RuntimeError("rank one gives up")  # no @record: the launcher still shows this
    waiting_for_the_others()
    """
)


def test_a_failure_names_the_rank_and_shows_where_the_others_were(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILS_WHILE_OTHERS_WAIT)
    code, err = _finish(ddpkit_run("--nproc", "2", str(script)))
    assert code == 1
    head = err[err.rindex("ddpkit: rank 1 failed (exit code 1)") :]
    assert "RuntimeError: rank one gives up" in head and 'raise RuntimeError("rank one gives up")' in head
    report = Path(re.search(r"where the other ranks were: (.+)$", head, re.M).group(1))
    text = report.read_text()
    assert "stacks of rank 0" in text and "in waiting_for_the_others" in text and "rank 1" not in text


THREADS = textwrap.dedent(
    """
    import os, sys, torch
    with open(sys.argv[1] + os.environ["RANK"], "w") as f:
        f.write(f"{os.environ.get('OMP_NUM_THREADS')} {torch.get_num_threads()}")
    """
)


def test_a_users_omp_num_threads_is_honoured(tmp_path, monkeypatch):
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    ours = max(1, len(os.sched_getaffinity(0)) // 2)  # what ddpkit gives each of 2 workers
    theirs = 2 if ours != 2 else 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(theirs))
    code, err = _finish(ddpkit_run("--nproc", "2", str(script), str(tmp_path / "rank")))
    assert code == 0, err[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [f"{theirs} {theirs}"] * 2


def test_bad_collective_timeout_is_one_line(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    done = ddpkit_cli(
        [sys.executable, "-m", "ddpkit", "run", "--collective-timeout", "-1", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "ddpkit: error: --collective-timeout -1 is below 0; give seconds, or 0 to turn hang reports off"
    )
