"""Checkpoints: weights (safetensors) + config JSON + training state, written under a temporary name and renamed.

Layout of `RUN/checkpoints/`:
    step-00000600/   model.safetensors, config.json, trainer_state.pt, meta.json
    latest           the name of the newest complete checkpoint (replaced atomically)
    best             the name of the checkpoint with the lowest validation loss

A checkpoint directory is complete before it gets its final name, and `latest` moves only after
that, so a crash while writing leaves the previous checkpoint as "latest". `trainer_state.pt`
holds only tensors and plain values and is read with `weights_only=True`. A checkpoint damaged
afterwards (a truncated file, NaN weights) is skipped by `load_newest_intact` in favour of the one before.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.io import save_model
from aiayn.rundir import CHECKPOINT_META as META_NAME
from aiayn.rundir import CHECKPOINT_STATE as STATE_NAME
from aiayn.rundir import WEIGHTS as WEIGHTS_NAME
from aiayn.rundir import atomic_write_bytes
from aiayn.weights import WeightsError, WeightsMismatch, load_weights, read_torch_file

logger = logging.getLogger(__name__)


def checkpoint_name(step: int) -> str:
    """`step-00000600` for step 600 (sorts by step)."""
    return f"step-{step:08d}"


def save_checkpoint(root: str | Path, model: nn.Module, state: dict[str, Any], *, step: int,
                    meta: dict[str, Any] | None = None) -> Path:
    """Write checkpoint `step` into `root` (a temporary directory renamed at the end) and point `latest` at it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        save_model(model, tmp, tokenizers_in=root.parent)  # the run's tokenizer, whose digest the weights keep
        with open(tmp / STATE_NAME, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        (tmp / META_NAME).write_text(json.dumps({"step": step, **(meta or {})}, indent=2) + "\n", encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as err:  # a full disk, say: name the checkpoint, not its temporary directory
        shutil.rmtree(tmp, ignore_errors=True)
        if err.errno is None:
            raise
        raise OSError(err.errno, err.strerror, str(final)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_bytes(root / "latest", (final.name + "\n").encode())
    return final


def _pointer(root: Path, name: str) -> Path | None:
    path = root / name
    if not path.is_file():
        return None
    target = root / path.read_text(encoding="utf-8").strip()
    return target if (target / WEIGHTS_NAME).is_file() and (target / STATE_NAME).is_file() else None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    root = Path(root)
    found = _pointer(root, "latest")
    if found is not None:
        return found
    complete = [p for p in list_checkpoints(root)]
    return complete[-1] if complete else None


def best_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint marked best, or None."""
    return _pointer(Path(root), "best")


def mark_best(root: str | Path, checkpoint: Path) -> None:
    """Point `best` at `checkpoint`."""
    atomic_write_bytes(Path(root) / "best", (checkpoint.name + "\n").encode())


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / WEIGHTS_NAME).is_file() and (p / STATE_NAME).is_file())


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, keeping `best` and `latest`; clear leftover temp dirs."""
    root = Path(root)
    keep = {p for p in (best_checkpoint(root), latest_checkpoint(root)) if p is not None}
    complete = list_checkpoints(root)
    keep.update(complete[-keep_last:] if keep_last else [])
    for path in complete:
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)
    for tmp in root.glob(".step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def load_checkpoint(checkpoint: str | Path, model: nn.Module) -> dict[str, Any]:
    """Load the weights into `model` (checked key by key) and return the training state (on the CPU).

    A checkpoint written on a GPU loads on a CPU-only machine and back: tensors come in on the CPU, and
    the optimiser's `load_state_dict` moves its state to where the parameters are.
    """
    checkpoint = Path(checkpoint)
    load_weights(model, checkpoint / WEIGHTS_NAME)
    state = read_torch_file(checkpoint / STATE_NAME)
    if not isinstance(state, dict) or "step" not in state:
        raise WeightsError(f"{checkpoint / STATE_NAME} is not an aiayn trainer state")
    return state


def load_newest_intact(root: str | Path, model: nn.Module) -> tuple[Path | None, dict[str, Any], list[str]]:
    """Load the newest checkpoint under `root` that reads cleanly, falling back over damaged ones.

    Returns:
        (checkpoint or None when there is none, its training state, one note per damaged checkpoint skipped).

    Raises:
        WeightsMismatch: a checkpoint is intact but made for another model (the run's sizes changed).
        WeightsError: every checkpoint is damaged.
    """
    damaged: list[str] = []
    for path in reversed(list_checkpoints(root)):
        try:
            return path, load_checkpoint(path, model), damaged
        except WeightsMismatch:
            raise
        except WeightsError as err:
            logger.warning("skipping damaged checkpoint %s: %s", path, err)
            damaged.append(f"{path.name}: {err}")
    if damaged:
        raise WeightsError(f"no intact checkpoint in {root}: {'; '.join(damaged)}")
    return None, {}, damaged


@torch.no_grad()
def average_checkpoints(model: nn.Module, checkpoints: list[Path]) -> None:
    """Set `model`'s parameters to the mean of those in `checkpoints` (section 6.1 averaged the last 5 or 20)."""
    if not checkpoints:
        raise ValueError("no checkpoints to average")
    import copy

    scratch = copy.deepcopy(model)
    total = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
    for path in checkpoints:
        load_weights(scratch, Path(path) / WEIGHTS_NAME)
        for name, p in scratch.named_parameters():
            total[name] += p.double()
    for name, p in model.named_parameters():
        p.copy_((total[name] / len(checkpoints)).to(p.dtype))
