"""A test that hangs past its timeout ends its test process with every thread's stack shown.

pytest-timeout raises in the test's main thread from SIGALRM, which cannot act while a C call
holds the GIL, nor on a teardown after it fired once: CI then waited out its own 90 minutes with no
name. faulthandler's watchdog needs neither: past the timeout and a margin it writes every thread's
stack to a file and ends the process; xdist reports the test as crashed (and, with
``--max-worker-restart 0``, stops rather than running it again), and the summary shows the stacks.
Loaded by tests/conftest.py; tests/test_suite_hang_stop.py checks it on a test that hangs.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

import pytest

STACKS_ENV = "TESTS_HANG_STACKS"  # the folder, set once by the main pytest process for its workers
MARGIN_ENV = "TESTS_HANG_MARGIN_S"  # seconds past the timeout (90 unless set)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the main process (xdist's workers inherit its env)
        os.environ[STACKS_ENV] = tempfile.mkdtemp(prefix="ddpkit-test-stacks-")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else item.config.getini("timeout") or 300)
    margin = float(os.environ.get(MARGIN_ENV, 90))
    with open(Path(os.environ[STACKS_ENV]) / f"{os.getpid()}.txt", "w") as stacks:
        stacks.write(f"{item.nodeid} ran past its {limit:.0f} s timeout + {margin:.0f} s; its stacks:\n")
        stacks.flush()
        faulthandler.dump_traceback_later(limit + margin, exit=True, file=stacks)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    os.unlink(stacks.name)


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or STACKS_ENV not in os.environ:
        return
    for path in sorted(Path(os.environ[STACKS_ENV]).glob("*.txt")):
        if "Timeout (" in (text := path.read_text()):  # faulthandler's first line; else another crash
            terminalreporter.write_sep("=", f"stacks of a hung test (process {path.stem})")
            terminalreporter.write_line(text)
    shutil.rmtree(os.environ.pop(STACKS_ENV), ignore_errors=True)
