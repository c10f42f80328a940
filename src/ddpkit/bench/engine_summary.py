"""``ddpkit bench engine``'s arithmetic: per-engine rows, paired ratios, the targets, the table.

Input is what every rank of the timed run gathered: per engine, per round, each step's seconds;
CPU and wall seconds; collectives and bytes of one profiled step. Peak RSS comes separately.
"""

from __future__ import annotations

import random
import statistics

# (engine, its median step over torch DDP's at most); and peak RSS of native at most torch DDP's.
RATIO_TARGETS = (("native", 1.00), ("native+bf16", 0.85))


def _job_rounds(ranks: list[dict], name: str) -> list[list[float]]:
    """Per round, each step's time on the slowest rank (solo: rank 0's only)."""
    per_rank = [r["rounds"][name] for r in ranks if any(r["rounds"][name])]
    return [[max(step) for step in zip(*blocks, strict=True)] for blocks in zip(*per_rank, strict=True)]


def _cpu_per_step(ranks: list[dict], name: str) -> float:
    """CPU seconds per step, averaged over the ranks that trained (solo: rank 0)."""
    per_rank = [(r["spent"][name][0], sum(map(len, r["rounds"][name]))) for r in ranks]
    return statistics.mean(cpu / steps for cpu, steps in per_rank if steps)


def _row(ranks: list[dict], name: str, rss: list[float] | None) -> dict:
    job = _job_rounds(ranks, name)
    steps = [t for block in job for t in block]
    calls, nbytes = ranks[0]["comm"].get(name, (0, 0))
    return {
        "median_ms": 1e3 * statistics.median(steps),
        "p90_ms": 1e3 * (statistics.quantiles(steps, n=10)[-1] if len(steps) > 1 else steps[0]),
        "cpu_ms_per_step": 1e3 * _cpu_per_step(ranks, name),
        "round_medians_ms": [1e3 * statistics.median(block) for block in job],
        "collectives_per_step": calls,
        "bytes_per_step": nbytes,
        "peak_rss_mb": rss,
    }


def _round_ratios(rows: dict[str, dict], name: str, base: str) -> list[float]:
    # Engines that ran in the same round saw the same machine load; the median of per-round
    # ratios cancels the load that drifts between rounds.
    pairs = zip(rows[name]["round_medians_ms"], rows[base]["round_medians_ms"], strict=True)
    return [a / b for a, b in pairs]


def _paired(rows: dict[str, dict], name: str, base: str) -> float:
    return statistics.median(_round_ratios(rows, name, base))


def interval90(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval for the median of ``ratios`` (seeded: the same data, the same answer).

    How far the median could move if the rounds were run again: on a shared 2-core machine it is
    often wider than the difference between two engines.
    """
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.05 * resamples)], medians[int(0.95 * resamples) - 1]


def summarize(
    timed: dict,
    rss: dict[str, list[float]],
    ratio_targets: tuple[tuple[str, float], ...] = RATIO_TARGETS,
    floors: dict[str, tuple[float, str]] | None = None,
) -> dict:
    """Per-engine medians, p90s, ratios to torch, scaling efficiency, CPU, traffic and peak RSS.

    Args:
        timed: what every rank of the timed run gathered.
        rss: peak RSS per rank, per engine (may be empty).
        ratio_targets: (engine, its median step over torch DDP's at most) pairs to check.
        floors: per engine, (the least ratio any engine could reach, what bounds it); the
            no-communication step where absent.
    """
    ranks = timed["ranks"]
    rows = {name: _row(ranks, name, rss.get(name)) for name in ranks[0]["rounds"]}
    for name, row in rows.items():
        if "torch" in rows:
            row["vs_torch"] = _paired(rows, name, "torch")
            row["vs_torch_interval90"] = interval90(_round_ratios(rows, name, "torch"))
            row["vs_torch_of_medians"] = row["median_ms"] / rows["torch"]["median_ms"]
        if "solo" in rows and name != "solo":
            # throughput at N processes over N times one process's (same per-process batch)
            row["scaling_efficiency"] = 1 / _paired(rows, name, "solo")
    waiting = ranks[-1]["spent"].get("solo", (0.0, 0.0))  # the last rank waits out `solo`
    # ~0 when the ranks waiting out `solo` really leave the machine to rank 0
    idle = waiting[0] / waiting[1] if waiting[1] and len(ranks) > 1 else None
    about = {"params": timed["params"], "threads_per_rank": timed["threads"], "nproc": timed["nproc"]}
    summary = {"engines": rows, **about, "solo_idle_rank_cpu_fraction": idle}
    summary["layouts"] = ranks[0].get("layouts", {})  # what each auto-layout engine measured and kept
    return summary | {"targets": targets(rows, ratio_targets, floors)}


NO_COMM = "the step without any communication"


def targets(
    rows: dict[str, dict],
    ratio_targets: tuple[tuple[str, float], ...] = RATIO_TARGETS,
    floors: dict[str, tuple[float, str]] | None = None,
) -> list[dict]:
    """The engine's targets, each with what was measured and whether it was met.

    ``none`` (no communication at all) is the floor: no engine's step can be shorter than the
    same step with nothing to send, so its ratio to torch is the best any engine can reach.
    On a slow link ``floors`` gives a higher one: the step cannot be shorter than its bytes take.
    """
    found = []
    for name, limit in ratio_targets:
        floor, why = (floors or {}).get(name, (rows.get("none", {}).get("vs_torch"), NO_COMM))
        if "vs_torch" in rows.get(name, {}):
            ratio = rows[name]["vs_torch"]
            interval = rows[name].get("vs_torch_interval90")
            target = {"target": f"{name} / torch <= {limit:.2f}", "limit": limit, "measured": ratio}
            found.append(target | {"interval90": interval, "met": ratio <= limit, "floor": floor, "why": why})
    native, torch_ = (rows.get(name, {}).get("peak_rss_mb") for name in ("native", "torch"))
    if native and torch_:
        peaks = [max(native), max(torch_)]
        found.append({"target": "peak RSS native <= torch", "measured": peaks, "met": peaks[0] <= peaks[1]})
    return found


def format_targets(found: list[dict]) -> str:
    """One line per target: measured, met or missed, and why where the why is known."""
    lines = []
    for t in found:
        if "limit" not in t:  # peak RSS
            value = f"{t['measured'][0]:.0f} vs {t['measured'][1]:.0f} MB"
            lines.append(f"target {t['target']:<28} {value:>22}  {'met' if t['met'] else 'missed'}")
            continue
        low, high = t["interval90"] or (t["measured"], t["measured"])
        value = f"{t['measured']:.3f} [{low:.3f}, {high:.3f}]"
        verdict = "met" if t["met"] else "missed"
        if not t["met"] and t["floor"] is not None and t["floor"] > t["limit"] and high >= t["floor"]:
            verdict += (
                f": below the floor, {t['floor']:.3f} of torch ({t.get('why', NO_COMM)}), "
                "so no engine can reach it on this machine"
            )
        elif low <= t["limit"] < high:
            verdict += ", within noise: the 90% interval of the median holds the limit"
        lines.append(f"target {t['target']:<28} {value:>22}  {verdict}")
    return "\n".join(lines)


def format_table(summary: dict) -> str:
    """The summary as a fixed-width table, one row per engine."""
    lines = [
        f"{'engine':<13}{'median ms':>10}{'p90 ms':>8}{'/torch':>8}{'scaling':>8}{'CPU ms':>8}"
        f"{'MB/step':>8}{'calls':>6}  peak RSS MB per rank"
    ]
    for name, row in summary["engines"].items():
        rss = " ".join(f"{v:.0f}" for v in row["peak_rss_mb"]) if row["peak_rss_mb"] else "-"
        ratio = f"{row['vs_torch']:.3f}" if "vs_torch" in row else "-"
        scaling = f"{row['scaling_efficiency']:.2f}" if "scaling_efficiency" in row else "-"
        lines.append(
            f"{name:<13}{row['median_ms']:>10.1f}{row['p90_ms']:>8.1f}{ratio:>8}{scaling:>8}"
            f"{row['cpu_ms_per_step']:>8.1f}{row['bytes_per_step'] / 1e6:>8.1f}"
            f"{row['collectives_per_step']:>6}  {rss}"
        )
    return "\n".join(lines)


def format_layouts(summary: dict) -> str:
    """One line per engine that chose its bucket layout: the trial's timings and the choice."""
    return "\n".join(f"{name} layout trial: {text}" for name, text in summary.get("layouts", {}).items())
