"""``metrics.jsonl`` (one JSON object per logged step) and the ``loss.png`` curve drawn from it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from fp8engine.training.checkpoint import atomic_write

__all__ = ["MetricsLog", "read_metrics", "plot_losses", "METRICS_NAME", "PLOT_NAME"]

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (a torn last line from a crash is skipped)."""
    records = []
    if not Path(path).is_file():
        return records
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class MetricsLog:
    """Appends one JSON line per logged step to ``out_dir/metrics.jsonl`` (flushed at once); no-op without a dir.

    ``resume_step``: keep only the records up to that step (a run resumed from step ``k`` drops what the
    interrupted run logged after its last checkpoint, so the file reads as one uninterrupted run).
    """

    def __init__(self, out_dir: Optional[Path], resume_step: Optional[int] = None):
        self.path = None if out_dir is None else Path(out_dir) / METRICS_NAME
        self._file = None
        if self.path is None:
            return
        if resume_step is not None:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            atomic_write(self.path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in kept)))
        else:
            self.path.write_text("")
        self._file = open(self.path, "a")

    def log(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def plot_losses(records: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Draw train loss per step and validation loss at eval steps into ``path`` (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
