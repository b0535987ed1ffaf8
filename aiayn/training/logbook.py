"""The run's metrics log (`metrics.jsonl`, copied to `metrics.csv`) and the loss / learning-rate plot."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from aiayn.rundir import atomic_open, atomic_output, atomic_write_text


class MetricsLog:
    """Append-only JSONL log of metric rows; each row has `split` ("train", "valid", "test") and `step`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, row: dict[str, Any]) -> None:
        """Add one row (flushed at once, so a killed run keeps its log)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(clean) + "\n")

    def rows(self) -> list[dict[str, Any]]:
        """Every row logged so far."""
        if not self.path.is_file():
            return []
        lines = [line for line in self.path.read_text(encoding="utf-8").split("\n") if line.strip()]
        rows = []
        for number, line in enumerate(lines, start=1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if number < len(lines):
                    raise ValueError(f"{self.path}:{number}: not a JSON row; the log is damaged") from None
                # the last row of a run killed while writing it: dropped (a resumed run logs it again)
        return rows

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after `step` (a resumed run logs them again)."""
        rows = [r for r in self.rows() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def write_csv(self, path: str | Path) -> None:
        """The same rows as CSV, one column per key seen."""
        rows = self.rows()
        keys: list[str] = []
        for row in rows:
            keys += [k for k in row if k not in keys]
        with atomic_open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)


def plot_curves(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Save a PNG with train/valid loss and the learning rate against the step (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("split") == "train" and r.get("loss") is not None]
    valid = [r for r in rows if r.get("split") == "valid" and r.get("loss") is not None]
    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train (label-smoothed)")
    if valid:
        ax_loss.plot([r["step"] for r in valid], [r["loss"] for r in valid], "o-", label="valid (NLL)")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss per token")
    ax_loss.set_title("loss")
    ax_loss.legend()
    ax_lr.plot([r["step"] for r in train], [r.get("lr", 0.0) for r in train])
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title("learning rate")
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=80)
    plt.close(fig)
    return Path(path)
