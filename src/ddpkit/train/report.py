"""`ddpkit report OUT`: a run's summary on the terminal and its curves in OUT/report.png."""

from __future__ import annotations

import json
from pathlib import Path

from ddpkit.diagnostics.stats import FIELDS, stragglers
from ddpkit.errors import ConfigError, OneLineParser
from ddpkit.launch.restarts import EVENTS
from ddpkit.run.monitor.metrics import read_metrics
from ddpkit.train.job import task_name


def summarize(records: list[dict], cfg: dict | None, events: list[dict] = ()) -> list[str]:
    """Lines of the summary: steps, losses, throughput, restarts (``events``, from
    OUT/events.jsonl) and where the time went."""
    logged = [r for r in records if "loss" in r]
    if not logged:
        raise ConfigError("the run logged no steps yet; wait for its first --log-every steps")
    last = logged[-1]
    steps = (cfg or {}).get("run", {}).get("steps")
    lines = [f"steps          {last['step']}" + (f" of {steps}" if steps else "")]
    lines.append(
        f"loss           first {logged[0]['loss']:.4f}  final {last['loss']:.4f}  "
        f"best {min(r['loss'] for r in logged):.4f}"
    )
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        lines.append(
            f"eval loss      final {evals[-1]['eval_loss']:.4f} over {evals[-1]['eval_samples']} samples"
        )
    speeds = sorted(r["samples_per_s"] for r in logged)
    lines.append(f"throughput     median {speeds[len(speeds) // 2]:.1f} samples/s (all ranks)")
    tokens = sorted(r["tokens_per_s"] for r in logged if "tokens_per_s" in r)
    if tokens:
        lines.append(f"tokens         median {tokens[len(tokens) // 2]:.0f} tokens/s (all ranks)")
    mfu = sorted(r["mfu"] for r in logged if "mfu" in r)
    if mfu:
        lines.append(f"MFU            median {mfu[len(mfu) // 2]:.1%} of the devices' peak")
    peaks = [r["peak_rss_mb"] for r in logged if "peak_rss_mb" in r]
    cuda = [r["peak_cuda_mb"] for r in logged if "peak_cuda_mb" in r]
    if peaks:
        device = f", {max(cuda):.0f} MiB allocated on a GPU" if cuda else ""
        lines.append(f"peak memory    {max(peaks):.0f} MiB resident on the largest rank{device}")
    lines += [restart_line(event) for event in events if event.get("event") == "restart"]
    total = sum(r.get("time_s", 0.0) for r in logged)
    lines.append(f"time logged    {total:.2f}s; per rank (seconds, summed over the run):")
    lines += rank_totals(logged)
    return lines


def restart_line(event: dict) -> str:
    """One restart the launcher noted in OUT/events.jsonl (launch/restarts.py)."""
    line = f"restart        {event['restart']} of {event['of']}: local rank {event['local_rank']} on "
    line += f"{event['host']} failed first ({event['why']})"
    return line + (f"; resumed from step {event['step']}" if event["step"] is not None else "")


def rank_totals(logged: list[dict]) -> list[str]:
    """Each rank's data / compute / comm-wait seconds over the whole run, stragglers marked."""
    totals: dict[int, dict[str, float]] = {}
    for record in logged:
        for row in record.get("ranks", []):
            mine = totals.setdefault(row["rank"], dict.fromkeys(FIELDS, 0.0))
            for field in FIELDS:
                mine[field] += row[field]
    rows = [{"rank": rank, **values} for rank, values in sorted(totals.items())]
    slow = dict(stragglers(rows)) if rows else {}
    lines = ["  rank    data_s  compute_s  comm_wait_s"]
    for row in rows:
        flag = f"  straggler ({slow[row['rank']]:.1f}x median)" if row["rank"] in slow else ""
        lines.append(
            f"  {row['rank']:>4}  {row['data_s']:8.2f}  {row['compute_s']:9.2f}  "
            f"{row['comm_wait_s']:11.2f}{flag}"
        )
    return lines


def plot_report(records: list[dict], png: Path, title: str) -> None:
    """Loss (and eval loss) and throughput against step, one above the other."""
    from matplotlib.figure import Figure  # here, not above: see ddpkit.run.monitor.metrics.plot_loss

    logged = [r for r in records if "loss" in r]
    fig = Figure(figsize=(7, 6), dpi=100)
    (top, bottom) = fig.subplots(2, 1, sharex=True)
    top.plot([r["step"] for r in logged], [r["loss"] for r in logged], label="train loss")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        top.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="o", label="eval loss")
    top.set_ylabel("loss")
    top.legend()
    top.set_title(title)
    bottom.plot([r["step"] for r in logged], [r["samples_per_s"] for r in logged], color="tab:green")
    bottom.set_ylabel("samples / s")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="ddpkit report", description="Summarize a training run.")
    parser.add_argument("out", help="the run's --out directory")
    ns = parser.parse_args(argv)
    out = Path(ns.out)
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(
            f"{str(out)!r} has no metrics.jsonl; give the --out directory of a ddpkit train run"
        )
    records = read_metrics(metrics)
    saved = out / "config.json"
    cfg = json.loads(saved.read_text(encoding="utf-8")) if saved.is_file() else None
    events = read_metrics(out / EVENTS) if (out / EVENTS).is_file() else []
    print("\n".join(summarize(records, cfg, events)))
    plot_report(
        records, out / "report.png", title=f"{task_name(cfg['train']['task']) if cfg else out.name}: {out}"
    )
    print(f"wrote {out / 'report.png'}")
    return 0
