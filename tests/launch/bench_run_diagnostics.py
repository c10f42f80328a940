"""What `ddpkit run`'s worker diagnostics cost a plain DDP step, side by side in one run.

    ddpkit run --nproc 2 tests/launch/bench_run_diagnostics.py [ROUNDS] [STEPS]

A plain DDP script (an MLP, SGD) that, in every round, takes STEPS steps with the worker's
progress thread running and STEPS with it paused, in alternating order so that drift cancels.
Rank 0 prints the median step with and without, and the ratio's median and 90% interval over
the rounds. What runs throughout, because it cannot be paused from here: faulthandler and
PR_SET_PDEATHSIG (nothing per step), and the launcher's own monitor in the launcher process
(about 0.2 ms of CPU a second; `python tests/launch/bench_run_diagnostics.py --launcher` times it).
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def block(model, opt, x, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def main(rounds: int, steps: int) -> None:
    boot = sys.modules.get("ddpkit_worker_boot")
    assert boot is not None and boot._progress, "run me under ddpkit run (with --collective-timeout > 0)"
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]
    model = DDP(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(128, 1024)
    block(model, opt, x, steps)  # warm-up
    timed: list[dict[str, list[float]]] = []
    for r in range(rounds):
        timed.append({})
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            boot.resume_progress() if mode == "on" else boot.pause_progress()
            dist.barrier()
            timed[-1][mode] = block(model, opt, x, steps)
        boot.resume_progress()
    if dist.get_rank() == 0:
        print(json.dumps(summarize(timed, steps)), flush=True)
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def pooled_ratio(rounds: list[dict[str, list[float]]]) -> float:
    """Median step with the diagnostics over the median step without, over all the rounds given."""
    on = [t for r in rounds for t in r["on"]]
    off = [t for r in rounds for t in r["off"]]
    return statistics.median(on) / statistics.median(off)


def summarize(rounds: list[dict[str, list[float]]], steps: int, resamples: int = 2000) -> dict:
    """The pooled ratio, and its 90% interval from resampling whole rounds (load drifts by round)."""
    rng = random.Random(0)
    boot = sorted(pooled_ratio(rng.choices(rounds, k=len(rounds))) for _ in range(resamples))
    return {
        "median_step_on_ms": 1e3 * statistics.median(t for r in rounds for t in r["on"]),
        "median_step_off_ms": 1e3 * statistics.median(t for r in rounds for t in r["off"]),
        "ratio": pooled_ratio(rounds),
        "ratio_90pct": [boot[int(0.05 * resamples)], boot[int(0.95 * resamples)]],
        "rounds": len(rounds),
        "steps_per_block": steps,
    }


def time_launcher_tick(ticks: int = 200) -> None:
    """CPU time of one poll of the launcher's hang monitor, for two local ranks."""
    import os
    import tempfile
    from pathlib import Path

    from ddpkit.diagnostics.hang.monitor import HangMonitor
    from ddpkit.launch.stores import bound_store

    run_dir = Path(tempfile.mkdtemp())
    store = bound_store("127.0.0.1", 0, 10)
    monitor = HangMonitor(run_dir, 900)
    monitor.on_round(0, 1, store)
    for rank in range(2):
        (run_dir / f"progress-{rank}").write_text(
            f"{os.getpid()} 5 {time.time():.3f} 0 2 1800".ljust(63) + "\n"
        )
    start = time.thread_time()
    for _ in range(ticks):
        monitor._tick()
    print(f"launcher monitor: {(time.thread_time() - start) / ticks * 1e3:.3f} ms of CPU per poll")


if __name__ == "__main__":
    if sys.argv[1:] == ["--launcher"]:
        time_launcher_tick()
    else:
        main(*(int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (20, 20))
