"""tests/hang_watchdog.py, on a test whose hang SIGALRM cannot end: the suite stops and names it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HANGS = """
import signal, time, pytest

@pytest.mark.timeout(1)
def test_hangs_where_sigalrm_cannot_reach():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as a C call that never returns
    time.sleep(300)
"""


@pytest.mark.slow
def test_a_test_hung_past_its_timeout_ends_the_suite_with_its_stacks(tmp_path):
    (tmp_path / "test_hangs.py").write_text(HANGS)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "TESTS_HANG_MARGIN_S": "2"}
    env.pop("TESTS_HANG_STACKS", None)  # the inner pytest makes its own folder
    # The suite's own options: two xdist workers, the worker not replaced after it crashed. Without
    # the watchdog the hung test sleeps 300 s and this run ends in TimeoutExpired.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "hang_watchdog", "-p", "no:cacheprovider", "-n", "2",
         "--max-worker-restart", "0", "--timeout", "60", "test_hangs.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:]
    out = done.stdout
    assert "FAILED test_hangs.py::test_hangs_where_sigalrm_cannot_reach - worker 'gw" in out, out[-3000:]
    assert "stacks of a hung test" in out and "ran past its 1 s timeout + 2 s" in out
    assert 'test_hangs.py", line 7 in test_hangs_where_sigalrm_cannot_reach' in out
