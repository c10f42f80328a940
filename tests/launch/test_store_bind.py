"""A single-node launcher's stores listen on loopback alone, never on every interface.

torch's TCPStore has no authentication: from another machine (or network namespace), anyone who
reaches the port can read and overwrite every key. `ss -ltnp` shows where the launcher process
listens while its workers run; the multi-node case is in test_multinode_netns.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from run_scripts import SLEEP_SCRIPT, ddpkit_run, listening

from ddpkit.launch.ports import free_port

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("flags", [[], ["--standalone"], ["--nnodes", "1", "--master-port", "PORT"]])
def test_single_node_stores_listen_on_loopback_only(tmp_path, flags):
    script, ready = tmp_path / "sleep.py", tmp_path / "ready"
    script.write_text(SLEEP_SCRIPT)
    flags = [str(free_port()) if f == "PORT" else f for f in flags]
    launcher = ddpkit_run("--nproc", "2", *flags, str(script), str(ready))
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.05)
        addresses = listening(launcher.pid)
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.communicate(timeout=60)
    # The rendezvous store and the workers' store of the round.
    assert len(addresses) == 2, addresses
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
