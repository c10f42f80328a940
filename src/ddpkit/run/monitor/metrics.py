"""A run's records on rank 0: one JSON line per logged step, and the loss curve as a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO


class MetricsLog:
    """Appends one JSON object per logged step to ``OUT/metrics.jsonl``.

    Args:
        path: the file to append to; created if missing.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = None  # opened at the first write, after a resume truncated

    def write(self, record: dict) -> None:
        # Line-buffered: each line reaches the OS as it is written, so a killed run keeps every
        # line it logged. The file stays open: an open per line costs more than the write
        # (docs/engine.md, "Small costs behind the code's choices").
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(records: list[dict], png: Path, title: str = "training loss") -> None:
    """Draw loss against step into ``png``."""
    # Imported here: matplotlib's import is a noticeable part of start-up (docs/engine.md), and
    # every rank of every run imports ddpkit but only rank 0 plots, once. A Figure of its own
    # draws with Agg where the file is written, without pyplot: a notebook that imports ddpkit
    # keeps its own backend and plots.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.subplots()
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)


def truncate_after(path: Path, step: int) -> None:
    """Drop lines logged after ``step``: a resumed run redoes those steps and logs them again."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
