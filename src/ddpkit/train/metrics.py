"""Run records on rank 0: one JSON line per logged step, and the loss curve as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training machines; must precede pyplot's import
import matplotlib.pyplot as plt  # noqa: E402


class MetricsLog:
    """Appends one JSON object per logged step to ``OUT/metrics.jsonl``.

    Args:
        path: the file to append to; created if missing.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        # One line per write, flushed at once, so a killed run keeps every line it logged.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(records: list[dict], png: Path, title: str = "training loss") -> None:
    """Draw loss against step into ``png``."""
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
