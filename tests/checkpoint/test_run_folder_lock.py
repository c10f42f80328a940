"""The run-folder lock: exclusive while its holder lives, gone with it, never held by forked children."""

from __future__ import annotations

import os
import time

import pytest

from ddpkit.checkpoint.lock import OutLock, check_not_running
from ddpkit.errors import ConfigError


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    first = OutLock(tmp_path).acquire()
    try:
        with pytest.raises(ConfigError, match=rf"in use by a running ddpkit run \(pid {os.getpid()} on host"):
            check_not_running(tmp_path)
    finally:
        first.release()
    check_not_running(tmp_path)  # released: free again


def test_a_forked_child_does_not_keep_the_lock_after_its_parent_lets_go(tmp_path):
    lock = OutLock(tmp_path).acquire()
    child = os.fork()
    if child == 0:  # a DataLoader worker, say, that outlives its killed rank for a few seconds
        time.sleep(2)
        os._exit(0)
    try:
        time.sleep(0.3)
        lock.release()
        OutLock(tmp_path).acquire().release()  # the child still lives, and holds nothing
    finally:
        os.waitpid(child, 0)
