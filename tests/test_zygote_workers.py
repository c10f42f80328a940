"""The test zygote's forked workers (tests/zygote_workers.py) are what a fresh ``python -u SCRIPT``
worker is, in everything a script or a reader of /proc can see: the same probe, run under a
launcher forked from the zygote and under one started with subprocess, reports the same."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import zygote

pytestmark = pytest.mark.slow

PROBE = textwrap.dedent(
    """
    import json, os, signal, sys
    preloaded = "torch" in sys.modules  # imported before the script only in a forked worker
    import numpy as np, random, torch
    import ddpkit_worker_boot

    def area(name):
        with open(f"/proc/self/{name}", "rb") as f:
            return [p.decode() for p in f.read().split(b"\\0") if p]

    environ = dict(item.split("=", 1) for item in area("environ") if "=" in item)
    launcher = int(environ.pop("DDPKIT_AGENT_PID"))  # the worker boot takes it out of os.environ
    fds = sorted(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).split("-")[0]
                 for fd in os.listdir("/proc/self/fd") if fd not in ("0", "1", "2") and
                 os.path.exists(f"/proc/self/fd/{fd}"))
    fds = [name for name in fds if name != "progress"]  # opened by a thread at its first tick
    probe = {
        "argv": sys.argv, "path0": sys.path[0], "main": [__name__, __file__],
        "cmdline": area("cmdline"), "environ_is_os_environ": environ == dict(os.environ),
        "parent_is_launcher": os.getppid() == launcher, "session_leader": os.getsid(0) == os.getpid(),
        "boot_worker": ddpkit_worker_boot.WORKER, "threads": torch.get_num_threads(),
        "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)],
        "stdout_write_through": sys.stdout.write_through, "fds": fds,
        "draws": [torch.rand(1).item(), float(np.random.rand()), random.random()],
        "cwd": os.getcwd(), "rank": os.environ["RANK"], "preloaded": preloaded,
    }
    sys.stdout.write("PROBE " + json.dumps(probe) + "\\n")  # one write: the ranks share the file
    sys.exit("rank 1 says goodbye" if os.environ["RANK"] == "1" else 0)
    """
)


def _probes(stdout: str) -> dict[str, dict]:
    probes = [json.loads(line[6:]) for line in stdout.splitlines() if line.startswith("PROBE ")]
    return {p.pop("rank"): p for p in probes}


def test_a_forked_worker_shows_what_a_fresh_one_does(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    args = ["run", "--nproc", "2", str(script), "an argument"]
    forked = zygote.run(args, cwd=tmp_path)
    fresh = subprocess.run(
        [sys.executable, "-m", "ddpkit", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    for done in (forked, fresh):
        assert done.returncode == 1 and "rank 1 says goodbye" in done.stderr, done.stderr[-3000:]
    got, want = _probes(forked.stdout), _probes(fresh.stdout)
    assert set(got) == set(want) == {"0", "1"}
    draws = zip(got["0"]["draws"], got["1"]["draws"], strict=True)
    assert all(a != b for a, b in draws), "unseeded generators draw differently on each rank"
    for rank in got:
        assert got[rank].pop("preloaded") and not want[rank].pop("preloaded"), "the fork was not taken"
        got[rank].pop("draws"), want[rank].pop("draws")
        assert got[rank] == want[rank], rank
