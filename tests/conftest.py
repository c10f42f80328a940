"""Every test leaves no process, environment variable or process group behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (its import sets TORCHINDUCTOR_CACHE_DIR; do it before any test)
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from helpers import descendants  # noqa: E402


def _workers() -> set[int]:
    """Descendants except multiprocessing's resource tracker, which lives as long as pytest does."""
    found = set()
    for pid in descendants():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
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
