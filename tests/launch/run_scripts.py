"""Unmodified torch scripts for `ddpkit run` tests, and how the tests find their workers from outside."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import ddpkit_popen, descendants

# The seeds' fault-tolerance tutorial (pytorch/examples ddp-tutorial-series, multigpu_torchrun.py)
# on CPU: a plain DDP script that saves a snapshot every epoch and loads it when it starts. Its
# data and model are fixed, so a run restarted from snapshots ends with the uninterrupted model.
SNAPSHOT_SCRIPT = textwrap.dedent(
    """
    import time; started = time.time()
    import gc, os, sys
    def mark(what, at=None):  # for the test's timings only: "t WHAT WALL RESTART RANK", one write
        env = os.environ
        line = f"t {what} {at or time.time()} {env['TORCHELASTIC_RESTART_COUNT']} {env['RANK']}\\n"
        os.write(1, line.encode())
    mark("started", started)
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    def main(snapshot_path, epochs):
        mark("imported")
        dist.init_process_group("gloo")
        mark("joined")
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(256, 20, generator=g), torch.randn(256, 1, generator=g))
        loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, shuffle=False))
        model = torch.nn.Linear(20, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        epochs_run = 0
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path, weights_only=True)
            model.load_state_dict(snapshot["MODEL_STATE"])
            opt.load_state_dict(snapshot["OPT_STATE"])
            epochs_run = snapshot["EPOCHS_RUN"]
        mark("loaded")
        ddp, stepped = DDP(model), False
        for epoch in range(epochs_run, epochs):
            for x, y in loader:
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()
                if not stepped:
                    mark("stepped")
                    stepped = True
            if dist.get_rank() == 0:
                snapshot = {"MODEL_STATE": model.state_dict(), "OPT_STATE": opt.state_dict()}
                snapshot["EPOCHS_RUN"] = epoch + 1
                torch.save(snapshot, snapshot_path + ".tmp")
                os.replace(snapshot_path + ".tmp", snapshot_path)
            time.sleep(0.3)  # room for the test to kill a worker mid-run
        del ddp, opt
        gc.collect()
        dist.destroy_process_group()

    main(sys.argv[1], int(sys.argv[2]))
    """
)

# Trains until killed, with two DataLoader worker processes per rank; writes READY once stepping.
FOREVER_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 1))
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, num_workers=2, persistent_workers=True)
    step = 0
    while True:
        for x, y in loader:
            (model(x) - y).pow(2).mean().backward()
            step += 1
            if step == 5 and dist.get_rank() == 0:
                open(sys.argv[1], "w").close()
    """
)


# Starts, says so, and waits to be stopped: no torch, so it is up in a moment.
SLEEP_SCRIPT = textwrap.dedent(
    """
    import sys, time
    open(sys.argv[1], "w").close()
    time.sleep(300)
    """
)


def ddpkit_run(*args: str) -> subprocess.Popen:
    """`python -m ddpkit run ARGS` in its own session, with its output captured (its launcher
    forked from the test zygote)."""
    return ddpkit_popen(
        [sys.executable, "-m", "ddpkit", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def workers(launcher: int, script: str) -> dict[tuple[int, int], int]:
    """(restart count, rank) -> pid of each worker ``launcher`` started to run ``script``.

    Only its direct children: a rank's DataLoader workers share its command line and environment.
    """
    found = {}
    for pid in descendants(launcher):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
        if parent == launcher and script.encode() in cmdline and "RANK" in env:
            found[(int(env["TORCHELASTIC_RESTART_COUNT"]), int(env["RANK"]))] = pid
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def listening(pid: int, namespace: str | None = None) -> list[str]:
    """The ADDR:PORT every TCP socket of process ``pid`` listens on, from ``ss -ltnp``."""
    cmd = ["ss", "-ltnpH"]
    if namespace is not None:
        cmd = ["ip", "netns", "exec", namespace, *cmd]
    lines = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.splitlines()
    return [line.split()[3] for line in lines if f"pid={pid}," in line]


# Two ranks step a DDP model; at step 5 one of them (HANG_RANK, default 1) never reaches the
# gradient all-reduce: it spins in a Python loop, so its stack shows where it is.
HANG_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def stuck_forever():
        while True:
            time.sleep(0.1)

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(4, 2))
    for step in range(1000000):
        if step == 5:
            open(sys.argv[1], "w").close()
            if dist.get_rank() == int(os.environ.get("HANG_RANK", "1")):
                stuck_forever()
        model(torch.ones(8, 4)).sum().backward()
        time.sleep(0.01)
    """
)
