"""Every test leaves no process, environment variable or process group behind; slow files run first;
a test that hangs past its timeout ends its test process with every thread's stack shown."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (its import sets TORCHINDUCTOR_CACHE_DIR; do it before any test)
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from hang_watchdog import pytest_configure, pytest_runtest_protocol, pytest_terminal_summary  # noqa: E402, F401
from helpers import descendants  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--keep-file-order",
        action="store_true",
        help="run the test files in the order given, not the slow files first",
    )


@pytest.hookimpl(tryfirst=True)  # orders every file, before `-m` deselects some tests
def pytest_collection_modifyitems(config, items):
    if config.getoption("--keep-file-order"):
        return
    # xdist's loadfile hands out whole files in this order (--no-loadscope-reorder): the longest
    # files first, then the others by their number of slow tests, the fast files last, so the fast
    # ones fill in around the long ones and both workers end at about the same time. A file's own
    # tests keep their order.
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def weight(path: str) -> tuple[int, int]:
        slow = sum(test.get_closest_marker("slow") is not None for test in files[path])
        return (-LONGEST.index(path) if path in LONGEST else -len(LONGEST), slow)

    items[:] = [item for path in sorted(files, key=weight, reverse=True) for item in files[path]]


# The longest files, longest first (minutes each on 2 busy cores). The order only sets how soon a
# file starts; a file missing here still runs, after these.
LONGEST = [
    "tests/run/test_run_habits.py",
    "tests/check/test_check_command.py",
    "tests/launch/test_multinode_netns.py",
    "tests/run/test_run_stream.py",
    "tests/train/test_exact_resume.py",
    "tests/outside/test_ray_train.py",
    "tests/run/test_run_compile.py",
    "tests/run/test_run_examples_resume.py",
    "tests/outside/test_diffusers_ddpm.py",
    "tests/dist/test_launcher_envs.py",
]


def _workers() -> set[int]:
    """Descendants except multiprocessing's resource trackers and the servers that live as long as
    pytest does, each a child of this process: multiprocessing's forkserver (run_ranks') and the
    test zygote (tests/zygote.py). What those two fork (ranks, launchers) shares their command
    line but is a grandchild, and is counted."""
    found = set()
    for pid in descendants():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        server = any(name in cmdline for name in (b"forkserver", b"ddpkit-test-zygote"))
        if b"resource_tracker" not in cmdline and not (server and parent == os.getpid()):
            found.add(pid)
    return found


def _wait_gone(timeout: float = 10.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := _workers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(autouse=True)
def leaves_nothing_behind():
    environ = dict(os.environ)
    yield
    left = _wait_gone()
    assert not left, f"test left processes running: {sorted(left)}"
    # pytest itself sets PYTEST_CURRENT_TEST around each test phase.
    keys = (set(environ) | set(os.environ)) - {"PYTEST_CURRENT_TEST"}
    changed = {k for k in keys if environ.get(k) != os.environ.get(k)}
    for k in changed:
        os.environ.pop(k, None)
        if k in environ:
            os.environ[k] = environ[k]
    assert not changed, f"test changed environment variables: {sorted(changed)}"
    assert not (dist.is_available() and dist.is_initialized()), "test left a process group initialized"


@pytest.fixture
def short_tmpdir(monkeypatch):
    """TMPDIR set to a new short folder (removed afterwards) for a launcher whose workers start
    DataLoader workers: multiprocessing puts its socket (pymp-*/listener-*) under TMPDIR, and
    AF_UNIX takes 107 bytes at most, which a tmp_path under a long base (a CI folder) overruns:
    the workers then hang passing their first batch."""
    path = Path(tempfile.mkdtemp(prefix="dk", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)
