"""``ddpkit bench engine --link RATE``: the engines where communication is the bottleneck.

One process per emulated host (``bench.netns``: network namespaces on a switch, each host's
link capped at RATE by tc's tbf), the engines alternating in one run as in the loopback bench.
Besides the engines it measures, on the same hosts:

  link     the all-reduce of all the gradients alone (a float32 buffer as large as the model):
           the communication an uncompressed step cannot do without
  phases   forward, backward and optimizer step of one training step without communication

and from them two ideals: ``max(compute, comm)``, what perfect overlap of everything would give,
and ``forward + max(backward, comm) + optimizer``, what overlapping communication with backward
can give (the all-reduce needs gradients, which only backward makes). The first is the floor the
targets are checked against; bf16's comm is half the bytes, PowerSGD's floor is compute alone.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.bench.engine_rounds import EngineBenchConfig, measure
from ddpkit.bench.engine_summary import NO_COMM, format_layouts, format_table, format_targets, summarize
from ddpkit.bench.netns import emulated_hosts, exec_prefix, parse_rate, why_not
from ddpkit.dist import cpu_cores, destroy, init_distributed
from ddpkit.errors import ConfigError

# The engine's targets at 300 Mbit/s (median step over torch DDP's, after warm-up). PowerSGD's is
# checked at rank 8, the lowest rank tried whose loss after 300 steps is within 3% of uncompressed.
LINK_TARGETS = (("native", 0.85), ("native+bf16", 0.65), ("native+powersgd:8", 0.50))
WORKER = (sys.executable, "-m", "ddpkit.bench.engine_link")  # _worker, one per host
PORT = 29500  # the namespaces are new and empty: nothing else can hold a port in them


def run(cfg: EngineBenchConfig, rate_bps: float | None, hosts: int, timeout: float = 3600) -> dict:
    """The timed run on ``hosts`` emulated hosts; ``rate_bps`` None: an uncapped link."""
    threads = cfg.threads or max(1, cpu_cores() // hosts)
    with tempfile.TemporaryDirectory() as tmp, emulated_hosts(hosts, rate_bps) as machines:
        cfg_file, out_file = Path(tmp) / "config.json", Path(tmp) / "timed.json"
        cfg_file.write_text(json.dumps(asdict(cfg)), encoding="utf-8")
        procs = []
        for rank, host in enumerate(machines):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(hosts),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": machines[0].addr,
                "MASTER_PORT": str(PORT),
                "GLOO_SOCKET_IFNAME": host.iface,
                "OMP_NUM_THREADS": str(threads),
            }
            # a file, not a pipe: a host blocked on a full pipe would stall the other in a collective
            with open(Path(tmp) / f"host{rank}.log", "w", encoding="utf-8") as log:
                cmd = [*exec_prefix(host), *WORKER, str(cfg_file), str(out_file)]
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for rank, proc in enumerate(procs):
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                lines = (Path(tmp) / f"host{rank}.log").read_text(encoding="utf-8").strip().splitlines()
                raise RuntimeError(f"host {rank} of the link bench exited {proc.returncode}: {lines[-1:]}")
        timed = json.loads(out_file.read_text(encoding="utf-8"))
    return timed | {"rate_bps": rate_bps, "hosts": hosts}


def _probes(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """This rank's link all-reduce time and a step's phases without communication (medians)."""
    flat = torch.zeros(sum(p.numel() for p in base.parameters()))
    link = []
    for i in range(4):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        if i:  # the first one also sets up gloo's pairs
            link.append(time.perf_counter() - start)
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for i in range(6):
        dist.barrier()  # both hosts compute at once, as in a real step: they share the cores
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if i:
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                phases[name].append(seconds)
    return {"allreduce_s": statistics.median(link), "allreduce_bytes": 4 * flat.numel()} | {
        name + "_s": statistics.median(times) for name, times in phases.items()
    }


def ideals(timed: dict, compute_s: float | None = None) -> dict[str, float]:
    """Seconds: the link all-reduce, the compute phases, and the two ideal steps (module docstring).

    Args:
        timed: what the hosts gathered, each with its probes under "extra".
        compute_s: the no-communication engine's median step; the phases are scaled to add up to
            it, so the ideals see the same machine load as the engines did (the probes run once).
    """
    extra = [r["extra"] for r in timed["ranks"]]
    got = {key: max(e[key] for e in extra) for key in extra[0]}  # the slowest host sets the pace
    phases = ("forward_s", "backward_s", "optimizer_s")
    if compute_s is not None:
        scale = compute_s / sum(got[k] for k in phases)
        got |= {k: got[k] * scale for k in phases}
    compute, comm = sum(got[k] for k in phases), got["allreduce_s"]
    hosts = timed["hosts"]
    ring_bits = 8 * got["allreduce_bytes"] * 2 * (hosts - 1) / hosts  # what each host sends
    return got | {
        "compute_s": compute,
        "ideal_max_s": max(compute, comm),
        "ideal_overlap_s": got["forward_s"] + max(got["backward_s"], comm) + got["optimizer_s"],
        "link_rate_measured_bps": ring_bits / comm,
        "link_rate_bps": timed.get("rate_bps"),
    }


def summarize_link(timed: dict) -> dict:
    """The loopback bench's summary, with the ideals and the link's floors under each target.

    Floors are ratios to torch DDP: compute is the no-communication engine's paired ratio, the
    link's share is the all-reduce alone over torch's median step.
    """
    rows = summarize(timed, {})["engines"]
    none, torch_ = rows.get("none", {}), rows.get("torch", {})
    ideal = ideals(timed, none["median_ms"] / 1e3 if none else None)
    floors = {}
    if "vs_torch" in none:
        compute, comm = none["vs_torch"], 1e3 * ideal["allreduce_s"] / torch_["median_ms"]
        mb = ideal["allreduce_bytes"] / 1e6
        floors = {
            "native": (max(compute, comm), f"max(compute, all-reduce of {mb:.1f} MB)"),
            "native+bf16": (max(compute, comm / 2), f"max(compute, all-reduce of {mb / 2:.1f} MB)"),
        }
        # PowerSGD sends a few percent of the bytes (rank 8: 0.9 of 19.2 MB), at any rank.
        floors |= {name: (compute, NO_COMM) for name in rows if name.startswith("native+powersgd")}
        for key in ("ideal_max_s", "ideal_overlap_s"):
            ideal[key.replace("_s", "_vs_torch")] = 1e3 * ideal[key] / torch_["median_ms"]
    summary = summarize(timed, {}, LINK_TARGETS, floors)
    return summary | {"link": ideal, "hosts": timed["hosts"]}


def format_link(link: dict) -> str:
    """The link measurements and the ideals, a few lines."""
    rate = f"{link['link_rate_bps'] / 1e6:.0f} Mbit/s" if link["link_rate_bps"] else "uncapped"
    mb, ms = link["allreduce_bytes"] / 1e6, 1e3 * link["allreduce_s"]
    lines = [
        f"link {rate}: all-reduce of {mb:.1f} MB alone {ms:.0f} ms "
        f"(ring: {link['link_rate_measured_bps'] / 1e6:.0f} Mbit/s per host)",
        f"phases without communication: forward {1e3 * link['forward_s']:.0f} ms, backward "
        f"{1e3 * link['backward_s']:.0f} ms, optimizer {1e3 * link['optimizer_s']:.0f} ms",
    ]
    named = (("ideal_max", "max(compute, comm)"), ("ideal_overlap", "forward + max(backward, comm) + opt"))
    for key, text in named:
        ratio = link.get(f"{key}_vs_torch")
        tail = f"  {ratio:.3f} of torch" if ratio is not None else ""
        lines.append(f"ideal {text:<36} {1e3 * link[f'{key}_s']:>7.0f} ms{tail}")
    return "\n".join(lines)


def _worker(cfg_file: str, out_file: str) -> None:
    raw = json.loads(Path(cfg_file).read_text(encoding="utf-8"))
    cfg = EngineBenchConfig(**(raw | {"engines": tuple(raw["engines"])}))
    env = init_distributed("gloo")
    try:
        timed = measure(cfg, env.rank, env.world_size, extra=_probes)
        if env.is_rank0:
            Path(out_file).write_text(json.dumps(timed), encoding="utf-8")
    finally:
        destroy()


def unavailable() -> str | None:
    """Why the link bench cannot run here (one line), or None."""
    reason = why_not()
    return None if reason is None else f"ddpkit bench engine --link cannot run here: {reason}"


def main(ns: argparse.Namespace, cfg: EngineBenchConfig) -> int:
    """``ddpkit bench engine --link``: the table, the link and the ideals; 0 also when it cannot run."""
    rate = parse_rate(ns.link)
    if ns.hosts < 2:
        raise ConfigError(f"--hosts {ns.hosts} is below 2; a link needs two hosts, e.g. --hosts 2")
    reason = unavailable()
    if reason:
        print(reason)  # a machine without namespaces is not a failed benchmark
        return 0
    summary = summarize_link(run(cfg, rate, ns.hosts))
    summary |= {"config": asdict(cfg), "cpu_cores": cpu_cores(), "torch": torch.__version__}
    print(
        f"# ddpkit bench engine --link {ns.link}: GPT {summary['params'] / 1e6:.1f}M params, "
        f"{ns.hosts} hosts x 1 process x {summary['threads_per_rank']} threads, "
        f"{cfg.blocks} rounds x {cfg.steps_per_block} steps"
    )
    print("\n".join(filter(None, (format_table(summary), format_layouts(summary)))))
    print(format_link(summary["link"]))
    print(format_targets(summary["targets"]))
    if ns.json:
        ns.json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
