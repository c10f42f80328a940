"""`ddpkit report OUT`: a run's summary on the terminal and its curves in OUT/report.png."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from ddpkit.errors import ConfigError, OneLineParser
from ddpkit.train.config import TrainConfig
from ddpkit.train.metrics import read_metrics


def summarize(records: list[dict], cfg: TrainConfig | None) -> list[str]:
    """Lines of the summary: steps, losses, throughput and where the time went."""
    logged = [r for r in records if "loss" in r]
    if not logged:
        raise ConfigError("the run logged no steps yet; wait for its first --log-every steps")
    last = logged[-1]
    lines = [f"steps          {last['step']}" + (f" of {cfg.steps}" if cfg and cfg.epochs is None else "")]
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
    data, compute = last.get("data_s", 0.0), last.get("compute_s", 0.0)
    total = sum(r.get("time_s", 0.0) for r in logged)
    lines.append(
        f"time (rank 0)  data {data:.2f}s  compute+communication {compute:.2f}s  of {total:.2f}s logged"
    )
    return lines


def plot_report(records: list[dict], png: Path, title: str) -> None:
    """Loss (and eval loss) and throughput against step, one above the other."""
    logged = [r for r in records if "loss" in r]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), dpi=100, sharex=True)
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
    plt.close(fig)


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
    cfg = TrainConfig.from_json(saved.read_text(encoding="utf-8")) if saved.is_file() else None
    print("\n".join(summarize(records, cfg)))
    plot_report(records, out / "report.png", title=f"{cfg.workload if cfg else out.name}: {out}")
    print(f"wrote {out / 'report.png'}")
    return 0
