"""What the benchmarks print and write: nccl-tests-style tables, JSON records and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

# nccl-tests' names for the element types, shown in the table's type column.
NCCL_TYPE_NAMES = {
    "float32": "float",
    "float64": "double",
    "float16": "half",
    "bfloat16": "bfloat16",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
}

_COMM_HEAD = (
    f"#{'op':>14} {'size':>11} {'count':>11} {'type':>8} {'redop':>6} {'root':>5} "
    f"{'time':>9} {'algbw':>8} {'busbw':>8} {'#wrong':>7} {'memcpy':>8}\n"
    f"#{'':>14} {'(B)':>11} {'(elements)':>11} {'':>8} {'':>6} {'':>5} "
    f"{'(us)':>9} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7} {'(GB/s)':>8}"
)


def format_time_us(us: float) -> str:
    """Microseconds with nccl-tests' precision: fewer decimals as the number grows."""
    if us >= 10000:
        return f"{us:.0f}"
    return f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def comm_header(meta: dict) -> str:
    """The lines above the table: what ran, how times were combined, and the column names."""
    sizes, ranks = meta["sizes"], meta["world_size"]
    span = size_label(sizes[0])
    if len(sizes) > 1:
        span += f"..{size_label(sizes[-1])} ({len(sizes)} sizes)"
    return (
        f"# ddpkit bench comm: {ranks} rank{'s' if ranks > 1 else ''}, "
        f"{meta['backend']} on {meta['device']}, "
        f"{meta['dtype']}, {span}, "
        f"{meta['warmup']} warm-up + {meta['iters']} timed iterations\n"
        f"# time: {AVERAGE_TEXT[meta['average']]}\n"
        "# memcpy: torch copy_ of the same number of bytes on rank 0 alone (bytes / time)\n#\n" + _COMM_HEAD
    )


AVERAGE_TEXT = {
    "mean": "mean over ranks of each rank's mean time per iteration (nccl-tests' default, -a 1)",
    "max": "slowest rank's mean time per iteration (nccl-tests -a 3)",
    "min": "fastest rank's mean time per iteration (nccl-tests -a 2)",
    "rank0": "rank 0's mean time per iteration (nccl-tests -a 0)",
}


def comm_row(rec: dict) -> str:
    """One table row; an unsupported operation shows why instead of numbers."""
    left = (
        f" {rec['op']:>14} {rec['size_bytes']:>11} {rec['count']:>11} {rec['type']:>8} "
        f"{rec['redop'] or 'none':>6} {rec['root']:>5} "
    )
    if rec["status"] != "ok":
        return left + f"{rec['status']:>9}"
    memcpy = "" if rec["memcpy_gbps"] is None else f"{rec['memcpy_gbps']:.2f}"
    return left + (
        f"{format_time_us(rec['time_us']):>9} {rec['algbw_gbps']:>8.3f} {rec['busbw_gbps']:>8.3f} "
        f"{rec['wrong']:>7} {memcpy:>8}"
    )


def comm_summary(records: list[dict]) -> str:
    """nccl-tests' closing lines: wrong elements over all rows, and the mean bus bandwidth."""
    measured = [r for r in records if r["status"] == "ok"]
    wrong = sum(r["wrong"] for r in measured)
    skipped = len(records) - len(measured)
    mean_busbw = sum(r["busbw_gbps"] for r in measured) / len(measured) if measured else float("nan")
    lines = [
        f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
        f"# Avg bus bandwidth    : {mean_busbw:.3f} GB/s",
    ]
    if skipped:
        lines.append(f"# Not measured         : {skipped} rows (see their status)")
    return "\n".join(lines)


def size_label(nbytes: int) -> str:
    """1024 -> 1K, 3 * 2**20 -> 3M; exact multiples only, else plain bytes."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def scaling_table(records: list[dict], meta: dict) -> str:
    """Throughput and efficiency per engine and process count."""
    how = (
        f"global batch {meta['global_batch']} at every process count"
        if meta["scaling"] == "strong"
        else f"{meta['batch_per_process']} samples per process (global batch grows with the count)"
    )
    lines = [
        f"# ddpkit bench scaling: {meta['workload']}, {meta['scaling']} scaling: {how}",
        f"# {meta['steps']} steps per run, the first {meta['warmup']} excluded; "
        f"efficiency = speedup / (nproc / {meta['base_nproc']}); {meta['threads_per_process']} CPU thread(s) "
        "per process",
        f"#{'engine':>13} {'nproc':>6} {'batch':>6} {'batch/proc':>10} {'samples/s':>11} "
        f"{'step (ms)':>10} {'speedup':>8} {'efficiency':>11}",
    ]
    for r in records:
        lines.append(
            f" {r['engine']:>13} {r['nproc']:>6} {r['global_batch']:>6} {r['batch_per_process']:>10} "
            f"{r['samples_per_s']:>11.1f} {r['step_ms']:>10.2f} {r['speedup']:>8.2f} "
            f"{100 * r['efficiency']:>10.1f}%"
        )
    return "\n".join(lines)


def write_json(path: Path, meta: dict, records: list[dict]) -> None:
    """Write ``{"meta": ..., "records": [...]}``; NaN becomes null so any JSON reader accepts it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = [{k: _finite_or_none(v) for k, v in r.items()} for r in records]
    path.write_text(json.dumps({"meta": meta, "records": clean}, indent=2) + "\n", encoding="utf-8")


def _finite_or_none(value: object) -> object:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def plot_comm(records: list[dict], png: Path, title: str) -> None:
    """busbw against size, one line per operation (reducing ones with their first redop), memcpy dashed."""
    from matplotlib.figure import Figure  # here, not above: see ddpkit.run.monitor.metrics.plot_loss
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.subplots()
    shown: dict[str, str | None] = {}
    for r in records:
        shown.setdefault(r["op"], r["redop"])
    for op, redop in shown.items():
        rows = [r for r in records if r["op"] == op and r["redop"] == redop and r["status"] == "ok"]
        if rows:
            label = op if redop is None else f"{op} ({redop})"
            ax.plot([r["size_bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker=".", label=label)
    copies = sorted({(r["size_bytes"], r["memcpy_gbps"]) for r in records if r.get("memcpy_gbps")})
    if copies:
        ax.plot(*zip(*copies, strict=True), "k--", label="memcpy (one rank)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: size_label(int(x))))
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


def plot_scaling(records: list[dict], png: Path, title: str) -> None:
    """Throughput (with the ideal linear line) and efficiency against process count, per engine."""
    from matplotlib.figure import Figure  # here, not above: see ddpkit.run.monitor.metrics.plot_loss

    fig = Figure(figsize=(6, 7), dpi=100)
    (top, bottom) = fig.subplots(2, 1, sharex=True)
    for engine in dict.fromkeys(r["engine"] for r in records):
        rows = [r for r in records if r["engine"] == engine]
        counts = [r["nproc"] for r in rows]
        top.plot(counts, [r["samples_per_s"] for r in rows], marker="o", label=engine)
        base = rows[0]["samples_per_s"] / rows[0]["nproc"]
        top.plot(counts, [base * n for n in counts], ls=":", color="gray", label=f"{engine} ideal")
        bottom.plot(counts, [100 * r["efficiency"] for r in rows], marker="o", label=engine)
    top.set_ylabel("samples / s")
    top.set_title(title)
    top.legend(fontsize=8)
    bottom.set_ylabel("scaling efficiency (%)")
    bottom.set_xlabel("processes")
    bottom.axhline(100, color="gray", ls=":")
    bottom.set_xticks(sorted({r["nproc"] for r in records}))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
