"""A launcher stopped by a signal: the workers get it and a grace period, and it says what happened.

The scripts import nothing of torch, so they are up in a moment; the ddpkit.Run script is the
example a user starts from, run under `ddpkit run`, as a SLURM job would be.
"""

from __future__ import annotations

import json
import signal
import textwrap
import time
from pathlib import Path

import pytest
from run_scripts import SLEEP_SCRIPT, alive, ddpkit_run, workers

pytestmark = pytest.mark.slow

# Says it is up, then ignores SIGTERM: only the grace period's SIGKILL or a second signal ends it.
STUBBORN_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(sys.argv[1] + os.environ["RANK"], "w").close()
    time.sleep(300)
    """
)
EXAMPLE = Path(__file__).parents[2] / "examples" / "own_loop.py"


def _start(tmp_path: Path, text: str, *flags: str):
    """`ddpkit run` of two workers, once each has said it is up (the plain script: one of them)."""
    script, ready = tmp_path / "script.py", tmp_path / "ready"
    script.write_text(text)
    proc = ddpkit_run("--nproc", "2", *flags, str(script), str(ready))
    deadline, up = time.monotonic() + 60, 2 if text == STUBBORN_SCRIPT else 1
    while len(list(tmp_path.glob("ready*"))) < up or len(workers(proc.pid, str(script))) < 2:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.02)
    return proc, set(workers(proc.pid, str(script)).values())


def _stop(proc, pids: set[int], *signals: signal.Signals) -> tuple[int, list[str]]:
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.3)
    _, err = proc.communicate(timeout=60)
    assert not any(alive(pid) for pid in pids), "a worker outlived its launcher"
    assert "Traceback" not in err, err[-3000:]
    return proc.returncode, err.strip().splitlines()


def test_sigterm_reaches_a_plain_script_and_the_launcher_exits_143(tmp_path):
    code, lines = _stop(*_start(tmp_path, SLEEP_SCRIPT), signal.SIGTERM)
    assert code == 143, lines
    assert lines == [
        "ddpkit: stopped by SIGTERM: 2 workers ended by SIGTERM, which the script does not handle "
        "(nothing saved at the signal); the same command resumes from the newest checkpoint the script "
        "wrote (exit code 143)"
    ]


def test_workers_that_outlive_the_grace_period_are_killed(tmp_path):
    code, lines = _stop(*_start(tmp_path, STUBBORN_SCRIPT, "--grace-period", "1"), signal.SIGTERM)
    assert code == 143, lines
    assert lines[-1].startswith("ddpkit: stopped by SIGTERM: 2 workers still running after the 1 s"), lines


def test_a_second_signal_kills_the_workers_at_once(tmp_path):
    proc, pids = _start(tmp_path, STUBBORN_SCRIPT, "--grace-period", "120", "--preempt-signal", "USR1")
    code, lines = _stop(proc, pids, signal.SIGUSR1, signal.SIGINT)
    assert code == 130, lines  # Ctrl-C's
    assert lines[-1].startswith("ddpkit: stopped by a second signal (SIGINT after SIGUSR1)"), lines
    assert "workers killed at once" in lines[-1]


def test_an_early_warning_signal_makes_a_run_script_checkpoint_and_exit(tmp_path):
    out = tmp_path / "out"
    example = [str(EXAMPLE), "--out", str(out), "--size", "4000", "--micro-batch", "2"]
    proc = ddpkit_run("--nproc", "2", "--preempt-signal", "SIGUSR1", *example)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 90
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    signalled_at = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    proc.send_signal(signal.SIGUSR1)
    stdout, err = proc.communicate(timeout=90)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 128 + signal.SIGUSR1, err[-3000:]
    # The workers got SIGTERM (what ddpkit.Run and most scripts handle), checkpointed and exited.
    assert "ddpkit: preempted by SIGTERM at step" in stdout, stdout[-2000:]
    assert last.startswith("ddpkit: stopped by SIGUSR1: 2 workers (sent SIGTERM) exited "), last
    assert "with exit code 143 " in last and "Traceback" not in err
    (saved,) = (out / "checkpoints").iterdir()
    # The checkpoint is of the step the ranks agreed to stop at; that a run resumed from such a
    # checkpoint equals an uninterrupted one is tests/run/test_run_resume.py's SIGTERM test.
    assert int(saved.name.split("-")[1]) >= signalled_at >= 3
