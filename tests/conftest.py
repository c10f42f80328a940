"""Every test leaves no process, environment variable or process group behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from helpers import descendants  # noqa: E402


def _wait_gone(timeout: float = 10.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := descendants()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(autouse=True)
def leaves_nothing_behind():
    environ = dict(os.environ)
    yield
    left = _wait_gone()
    assert not left, f"test left processes running: {sorted(left)}"
    changed = {k for k in set(environ) | set(os.environ) if environ.get(k) != os.environ.get(k)}
    os.environ.clear()
    os.environ.update(environ)
    assert not changed, f"test changed environment variables: {sorted(changed)}"
    assert not (dist.is_available() and dist.is_initialized()), "test left a process group initialized"
