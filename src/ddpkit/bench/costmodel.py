"""A cost model of a data-parallel step: compute, buckets, and a ring all-reduce on a link.

Assumptions, each one a simplification to check against measurements (``check``):

- Weak scaling: every host keeps its batch, so compute per step (forward, backward, optimizer)
  is the same at any host count; the ideal step is the compute step.
- Gradients become ready at an even rate through backward, in the bucket order; a bucket's
  all-reduce may start when its last byte is ready, and all-reduces run one after another.
- A ring all-reduce of S bytes on n hosts is 2(n - 1) steps, each moving S / n bytes over
  every host's link at once: 2(n - 1) (latency + S / (n * bandwidth)). Full duplex links,
  a non-blocking switch; no compute slowed down by communication (gloo's copies and sums, the
  kernel's network work), which a host with spare cores or a NIC that offloads it gives.
- The step: forward + max(backward, end of the last all-reduce after backward began) + optimizer.

Scaling efficiency is the compute step over the predicted step: what fraction of n times one
host's throughput n hosts reach.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddpkit.bench.engine_rounds import EngineBenchConfig
from ddpkit.bench.netns import parse_rate
from ddpkit.errors import ConfigError, OneLineParser
from ddpkit.parallel.bucket import FIRST_BUCKET_BYTES, assign_buckets
from ddpkit.parallel.layout import Layout, split_layout

MIB = 2**20


@dataclass(frozen=True)
class Compute:
    """One host's step without communication.

    Args:
        forward_s: forward and loss, seconds.
        backward_s: backward, seconds; gradients become ready through it.
        optimizer_s: optimizer step, seconds.
    """

    forward_s: float
    backward_s: float
    optimizer_s: float

    @property
    def step_s(self) -> float:
        """The whole step, seconds."""
        return self.forward_s + self.backward_s + self.optimizer_s


@dataclass(frozen=True)
class Link:
    """Each host's link to the switch.

    Args:
        bandwidth_bps: bits per second each way.
        latency_s: one message's fixed cost (wire, switch, the stack on both ends), seconds.
    """

    bandwidth_bps: float
    latency_s: float


def ring_allreduce_s(nbytes: float, hosts: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``hosts`` hosts (0 for one host)."""
    if hosts < 2:
        return 0.0
    return 2 * (hosts - 1) * (link.latency_s + 8 * nbytes / hosts / link.bandwidth_bps)


def predict_step_s(compute: Compute, buckets: Sequence[float], hosts: int, link: Link) -> float:
    """Seconds of one step with ``buckets`` (bytes, in the order backward fills them)."""
    total, ready, comm_end = sum(buckets), 0.0, 0.0
    for nbytes in buckets:
        ready += nbytes
        start = max(compute.backward_s * ready / total, comm_end)  # from the start of backward
        comm_end = start + ring_allreduce_s(nbytes, hosts, link)
    return compute.forward_s + max(compute.backward_s, comm_end) + compute.optimizer_s


def layout_buckets(params: Sequence[nn.Parameter], layout: Layout, bytes_per_element: int = 4) -> list[int]:
    """Bytes of each bucket, in reverse registration order (backward's usual order)."""
    order = list(reversed(range(len(params))))
    groups = assign_buckets(params, order, layout.first_bytes, layout.cap_bytes, layout.last_bytes)
    return [bytes_per_element * sum(params[i].numel() for i in group) for group in groups]


def named_layouts(params: Sequence[nn.Parameter], cap_bytes: int = 25 * MIB) -> dict[str, Layout]:
    """The layouts the engines use: one bucket, the split one, and torch DDP's."""
    total = sum(p.numel() * p.element_size() for p in params)
    return {
        "one": Layout("one", cap_bytes, cap_bytes),
        "split": split_layout(total, cap_bytes),
        "torch": Layout("torch", FIRST_BUCKET_BYTES, cap_bytes),
    }


def table(compute: Compute, buckets: dict[str, list[int]], hosts: Sequence[int], link: Link) -> list[dict]:
    """Per host count and layout: predicted step and scaling efficiency."""
    rows = []
    for n in hosts:
        for name, sizes in buckets.items():
            step = predict_step_s(compute, sizes, n, link)
            rows.append({"hosts": n, "layout": name, "step_s": step, "efficiency": compute.step_s / step})
    return rows


def format_table(rows: list[dict], layouts: Sequence[str]) -> str:
    """Hosts down, layouts across: step ms and efficiency."""
    head = "hosts" + "".join(f"{name + ' ms':>14}{'eff':>6}" for name in layouts)
    lines = [head]
    for n in sorted({r["hosts"] for r in rows}):
        cells = {r["layout"]: r for r in rows if r["hosts"] == n}
        lines.append(
            f"{n:>5}"
            + "".join(f"{1e3 * cells[k]['step_s']:>14.1f}{cells[k]['efficiency']:>6.2f}" for k in layouts)
        )
    return "\n".join(lines)


def gpt_params() -> list[nn.Parameter]:
    """The benchmark GPT's parameters (4.8M; shapes only matter)."""
    with torch.device("meta"):
        return list(EngineBenchConfig().gpt().parameters())


def engine_buckets(name: str, params: Sequence[nn.Parameter]) -> dict[str, list[int]] | None:
    """The buckets a benchmark engine sends, by candidate layout (the auto layout: both); None
    for engines the model does not cover (no communication, PowerSGD)."""
    layouts = named_layouts(params)
    element = 2 if name.endswith("+bf16") or name.endswith("+fp16") else 4
    cap = re.fullmatch(r"native@([0-9.]+)mb", name)
    if cap:
        size = int(float(cap[1]) * MIB)
        chosen = {name: Layout(name, size, size)}
    elif name in ("torch", "native@1mib"):
        chosen = {"torch": layouts["torch"]}
    elif name in ("native", "native+bf16", "native+fp16"):
        chosen = {k: layouts[k] for k in ("one", "split")}  # it keeps the faster
    else:
        return None
    return {k: layout_buckets(params, layout, element) for k, layout in chosen.items()}


def check(summary: dict, latency_s: float) -> list[dict]:
    """Predicted against measured steps of a ``bench engine --link`` summary, round by round.

    In each round the compute is that round's no-communication step (split into phases as the
    run's probe measured), so load that drifts between rounds on a shared machine moves the
    prediction with the measurement; the error is the median over rounds. The link is the
    nominal rate with ``latency_s``.
    """
    got, rows = summary["link"], summary["engines"]
    phases = (got["forward_s"], got["backward_s"], got["optimizer_s"])
    link = Link(got["link_rate_bps"], latency_s)
    params, found = gpt_params(), []
    for name, row in rows.items():
        buckets = engine_buckets(name, params)
        if buckets is None:
            continue
        errors, predicted = [], []
        pairs = zip(rows["none"]["round_medians_ms"], row["round_medians_ms"], strict=True)
        for none_ms, measured_ms in pairs:
            compute = Compute(*(none_ms / 1e3 * p / sum(phases) for p in phases))
            step = min(predict_step_s(compute, sizes, summary["hosts"], link) for sizes in buckets.values())
            predicted.append(step)
            errors.append(step / (measured_ms / 1e3) - 1)
        found.append(
            {
                "engine": name,
                "measured_s": row["median_ms"] / 1e3,
                "predicted_s": statistics.median(predicted),
                "error": statistics.median(errors),
                "error_range": (min(errors), max(errors)),
            }
        )
    return found


def parser() -> argparse.ArgumentParser:
    """``ddpkit bench scaling --predict``'s command line."""
    p = OneLineParser(prog="ddpkit bench scaling --predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--predict", action="store_true", help="use the cost model (this command)")
    p.add_argument("--hosts", default="2,4,8,16,32,64", help="host counts")
    p.add_argument("--link", default="25gbit", help="each host's link rate, tc's units")
    p.add_argument("--latency-us", type=float, default=20.0, help="per-message latency, microseconds")
    p.add_argument("--forward-ms", type=float, default=90.0, help="compute per step (default: measured")
    p.add_argument("--backward-ms", type=float, default=160.0, help="here for the bench GPT, 4.8M")
    p.add_argument("--optimizer-ms", type=float, default=20.0, help="parameters, 1 thread per process)")
    p.add_argument("--check", type=Path, nargs="*", default=[], help="bench engine --link JSON files")
    p.add_argument("--json", type=Path, help="write the predictions to this file")
    return p


def main(argv: list[str]) -> int:
    """Print the predicted table (and, with --check, predicted against measured); 0 on success."""
    ns = parser().parse_args(argv)
    try:
        hosts = [int(h) for h in ns.hosts.split(",")]
    except ValueError:
        raise ConfigError(f"--hosts {ns.hosts!r} is not a list of counts; write e.g. 2,4,8") from None
    link = Link(parse_rate(ns.link), ns.latency_us * 1e-6)
    compute = Compute(ns.forward_ms / 1e3, ns.backward_ms / 1e3, ns.optimizer_ms / 1e3)
    params = gpt_params()
    buckets = {name: layout_buckets(params, layout) for name, layout in named_layouts(params).items()}
    rows = table(compute, buckets, hosts, link)
    mb = sum(buckets["one"]) / 1e6
    print(
        f"# predicted: ring all-reduce, {ns.link} links, {ns.latency_us:g} us latency, "
        f"compute {1e3 * compute.step_s:.0f} ms per step, {mb:.1f} MB of gradients"
    )
    print(format_table(rows, list(buckets)))
    checked = []
    for path in ns.check:
        summary = json.loads(path.read_text(encoding="utf-8"))
        run = {"file": str(path), "hosts": summary["hosts"], "rate_bps": summary["link"]["link_rate_bps"]}
        for c in check(summary, link.latency_s):
            checked.append(c | run)
            low, high = c["error_range"]
            print(
                f"{path.name}: {run['hosts']} hosts at {run['rate_bps'] / 1e6:.0f} Mbit/s  {c['engine']:<13} "
                f"measured {1e3 * c['measured_s']:7.1f} ms  predicted {1e3 * c['predicted_s']:7.1f} ms  "
                f"{100 * c['error']:+.0f}% (rounds {100 * low:+.0f}..{100 * high:+.0f}%)"
            )
    if ns.json:
        ns.json.write_text(json.dumps({"rows": rows, "checked": checked}, indent=2) + "\n", encoding="utf-8")
    return 0
