"""The run's metrics log (`metrics.jsonl`, copied to `metrics.csv`), the loss / learning-rate plot, and TensorBoard.

With `log_to=tensorboard` every row also goes to TensorBoard event files in RUN/tensorboard, one
scalar per metric under `split/name` (`train/loss`, `valid/bleu`, `test/accuracy`) at the row's step:
`tensorboard --logdir RUN/tensorboard`. TensorBoard is optional (`pip install tensorboard`).
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any

from aiayn.rundir import METRICS_LOG, TENSORBOARD, atomic_open, atomic_output, atomic_write_text


def require_tensorboard() -> None:
    """ModuleNotFoundError with the fix when TensorBoard is not installed (checked before a run starts)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ModuleNotFoundError("log_to=tensorboard needs the tensorboard package: pip install tensorboard (or "
                                  "drop log_to; metrics.jsonl, metrics.csv and curves.png are written either way)"
                                  ) from None


class TensorBoardLog:
    """Metric rows as TensorBoard scalars; the event file is opened at the first row (after the run began)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.purge_step: int | None = None  # a resumed run drops the events it logs again
        self._writer = None

    def append(self, row: dict[str, Any]) -> None:
        """Add every finite number of `row` as `split/name` at `row["step"]`."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.directory), purge_step=self.purge_step)
        split, step = row.get("split", "train"), int(row.get("step", 0))
        for name, value in row.items():
            if name not in ("split", "step") and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self._writer.add_scalar(f"{split}/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        """Close the event file (the next row opens a new one)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class MetricsLog:
    """Append-only JSONL log of metric rows; each row has `split` ("train", "valid", "test") and `step`.

    Args:
        path: the JSONL file.
        tensorboard: a directory for TensorBoard event files that receive every row too (None: none).
    """

    def __init__(self, path: str | Path, *, tensorboard: str | Path | None = None):
        self.path = Path(path)
        self.tensorboard = None if tensorboard is None else TensorBoardLog(tensorboard)

    def append(self, row: dict[str, Any]) -> None:
        """Add one row (flushed at once, so a killed run keeps its log)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(clean) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.append(row)

    def close(self) -> None:
        """Close what stays open between rows (TensorBoard's event file)."""
        if self.tensorboard is not None:
            self.tensorboard.close()

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
        if self.tensorboard is not None:
            self.tensorboard.purge_step = step + 1

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


def open_log(cfg: Any, run_dir: Path) -> MetricsLog:
    """The run's metrics log (with TensorBoard for `log_to=tensorboard`, checked installed before the run starts)."""
    if cfg.log_to == "tensorboard":
        require_tensorboard()
    return MetricsLog(run_dir / METRICS_LOG, tensorboard=run_dir / TENSORBOARD if cfg.log_to == "tensorboard" else None)


class TrainRows:
    """The progress bar and `train` rows of the trainer `t`'s loop: every `log_every` steps and the first, rank 0
    logs the mean loss of the steps since the last row (a context: the bar closes at its end)."""

    def __init__(self, t: Any):
        from tqdm.auto import tqdm

        self.t = t
        self.bar = tqdm(total=t.recipe.total_steps, initial=t.step, disable=not t.progress or t.rank != 0,
                        unit="step", dynamic_ncols=True, desc="train")
        self.window()

    def window(self) -> None:
        """Start counting the steps of the next row: their tokens and losses, and when the first began."""
        self.tokens, self.losses, self.began = 0, [], time.perf_counter()

    def add(self, stats: dict[str, float]) -> None:
        """Count a step (`stats`: the train step's) on the bar, and log its row when one is due."""
        t = self.t
        self.tokens += stats["tokens"]
        self.losses.append(stats["loss"])
        self.bar.update(1)
        if t.rank == 0 and (t.step % t.cfg.log_every == 0 or t.step == 1):
            elapsed = max(time.perf_counter() - self.began, 1e-9)
            row = {"split": "train", "step": t.step, "epoch": t.epoch, "loss": sum(self.losses) / len(self.losses),
                   "nll": stats["nll"], "lr": stats["lr"], "grad_norm": stats["grad_norm"],
                   "tokens_per_s": self.tokens / elapsed, "time_s": t.elapsed()}
            t.log.append(row)
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
            self.window()

    def __enter__(self) -> TrainRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


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
