"""Helpers shared by the tests: run a function on N gloo ranks, list leftover processes, run
scripts under ``ddpkit run`` (one, or several at once), wait for started processes, and read what
a run left in its folder (metrics, last step, saved weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import zygote
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

import ddpkit


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    start_method: str | None = "forkserver",
) -> list[Any]:
    """Run ``fn(env, *args)`` on ``world_size`` ranks joined over ``backend``; return each rank's result.

    ``fn`` must live at module level so it pickles into the children. They are forked by one
    forkserver per test process, with torch and ddpkit imported once (seconds of imports saved
    a rank); tests of ``ddpkit.launch`` itself pass ``start_method=None``, its default. The
    rendezvous uses a free port that ``ddpkit.launch`` picks, never a fixed one.
    """
    return ddpkit.launch(_rank_main, world_size, (fn, backend, args), start_method=start_method)


def _rank_main(fn: Callable[..., Any], backend: str, args: tuple) -> Any:
    env = ddpkit.init_distributed(backend)
    try:
        return fn(env, *args)
    finally:
        ddpkit.destroy()


def descendants(pid: int | None = None) -> set[int]:
    """Live processes below ``pid`` (this process by default), read from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # zombies are dead already; their parent just has not reaped them
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {os.getpid() if pid is None else pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


# `python -m ddpkit ARGS` with its imports done before it waits for HOST:PORT to answer. Started
# beside the node it joins or races, it acts the moment that node listens, however long imports
# take on a busy machine (seconds on 2 quiet cores, tens of seconds at a load average of 20).
_PRIMED = """
import socket, sys, time
import ddpkit.cli, ddpkit.launch.elastic, ddpkit.train.command  # the slow imports, done first
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        break
    except OSError:
        time.sleep(0.05)
sys.exit(ddpkit.cli.main(sys.argv[4:]))
"""


def primed_ddpkit(host: str, port: int, wait: float, *args: str) -> list[str]:
    """The command line of `python -m ddpkit ARGS` that, imports done, first waits up to ``wait``
    seconds for HOST:PORT to accept a connection."""
    return [sys.executable, "-c", _PRIMED, host, str(port), str(wait), *args]


def ddpkit_run(
    script: Path, out: Path, nproc: int, *extra: str, code: int = 0, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``ddpkit run --nproc N SCRIPT --out OUT EXTRA...``, asserting its exit code; the launcher is
    forked from the test zygote (tests/zygote.py), its workers are fresh interpreters."""
    args = ["run", "--nproc", str(nproc), str(script), "--out", str(out), *extra]
    done = zygote.run(args, timeout=timeout)
    assert done.returncode == code, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def ddpkit_cli(
    cmd: list, *, capture_output: bool = True, text: bool = True, timeout: float = 300, cwd=None, env=None
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` for a ``[sys.executable, "-m",
    "ddpkit", ...]`` command run to its end, its launcher forked from the test zygote."""
    assert list(map(str, cmd[:3])) == [sys.executable, "-m", "ddpkit"], cmd[:3]
    assert capture_output and text, "the zygote's runs capture their output as text"
    return zygote.run([str(a) for a in cmd[3:]], env=env, cwd=cwd, timeout=timeout)


def ddpkit_popen(cmd: list, **kwargs: Any) -> zygote.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` for a ``[sys.executable, "-m", "ddpkit", ...]`` command
    (stdout and stderr: None, DEVNULL, PIPE, a file, or stderr=STDOUT; text, env, cwd,
    start_new_session), its launcher forked from the test zygote: a process of its own whose
    parent is the zygote, with its workers forked from it."""
    assert list(map(str, cmd[:3])) == [sys.executable, "-m", "ddpkit"], cmd[:3]
    return zygote.Popen([str(a) for a in cmd[3:]], **kwargs)


def ddpkit_runs_at_once(
    root: Path, runs: dict[str, list[str]], env: dict | None = None, timeout: float = 240
) -> dict[str, int]:
    """``ddpkit run --standalone ARGS`` for every ``name: ARGS`` at once (on 2 cores side by side
    beats one after the other), each one's output in ROOT/NAME.log; their exit codes. Each runs in
    a session of its own, so one that hangs is killed with its workers, by process group; its
    launcher is forked from the test zygote."""

    def one(name: str) -> int:
        args = ["run", "--standalone", *runs[name]]
        return zygote.run(
            args, env=env, timeout=timeout, new_session=True, log=root / f"{name}.log"
        ).returncode

    with ThreadPoolExecutor(len(runs)) as pool:
        codes = {name: pool.submit(one, name) for name in runs}
        return {name: code.result() for name, code in codes.items()}


def wait_unlocked(out: Path, timeout: float = 15.0) -> bool:
    """Wait until no process holds OUT's run lock (a killed run's workers die a moment after their
    launcher: a run started at once, as a forked launcher is, would find the folder in use)."""
    from ddpkit.checkpoint.lock import check_not_running
    from ddpkit.errors import ConfigError

    deadline = time.monotonic() + timeout
    while True:
        try:
            check_not_running(out)
            return True
        except ConfigError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def metric_lines(out: Path) -> list[dict]:
    """Every line of OUT/metrics.jsonl."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def logged_losses(out: Path) -> list[float]:
    """The loss of every step line of OUT/metrics.jsonl."""
    return [line["loss"] for line in metric_lines(out) if "loss" in line]


def last_step(out: Path) -> int:
    """The step of the last line of OUT/metrics.jsonl; 0 while there is none (or it is half written)."""
    try:
        return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    except (OSError, ValueError, IndexError):
        return 0


def saved_weights(out: Path, name: str = "model") -> dict[str, torch.Tensor]:
    """The tensors of OUT/NAME.pt, loaded onto the CPU."""
    return torch.load(out / f"{name}.pt", map_location="cpu", weights_only=True)


def wait_all(procs: list[subprocess.Popen], deadline: float) -> list[int]:
    """Each exit code; at the deadline (a hang) SIGTERM to all that still run, SIGKILL 30 s later."""
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            break
    late = [proc for proc in procs if proc.poll() is None]
    for proc in late:
        proc.terminate()  # ddpkit run and mpirun stop their workers on SIGTERM
    for proc in late:
        try:
            proc.wait(timeout=max(deadline + 30 - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.wait() for proc in procs]


def powersgd_one_bucket_at_a_time(state, bucket):
    """torch's PowerSGD hook, waited for before the next bucket starts: the reference to compare with.

    torch's powerSGD_hook starts its P and Q all-reduces from future callbacks, which run on gloo's
    threads; with several buckets in flight the ranks then issue collectives in different orders
    and gloo aborts ("Received data size doesn't match expected size"). Waiting per bucket (what
    DataParallel does for torch's hooks) makes the reference deterministic without changing a value.
    """
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    future.wait()
    return future
