"""Checkpoints: weights (safetensors) + config JSON + training state, written under a temporary name and renamed.

Layout of `RUN/checkpoints/`:
    step-00000600/   model.safetensors, config.json, trainer_state.pt, meta.json
    latest           the name of the newest complete checkpoint (replaced atomically)
    best             the name of the checkpoint with the lowest validation loss

A checkpoint directory is complete before it gets its final name, and `latest` moves only after
that, so a crash while writing leaves the previous checkpoint as "latest". `trainer_state.pt`
holds only tensors and plain values and is read with `weights_only=True`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from aiayn.io import WEIGHTS_NAME, atomic_write_bytes, save_model

logger = logging.getLogger(__name__)

STATE_NAME = "trainer_state.pt"
META_NAME = "meta.json"


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
        save_model(model, tmp)
        with open(tmp / STATE_NAME, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        (tmp / META_NAME).write_text(json.dumps({"step": step, **(meta or {})}, indent=2) + "\n", encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
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
    """Load the weights into `model` (on whatever device it is) and return the training state (on the CPU).

    A checkpoint written on a GPU loads on a CPU-only machine and back: tensors come in on the CPU, and
    the optimiser's `load_state_dict` moves its state to where the parameters are.
    """
    checkpoint = Path(checkpoint)
    missing, unexpected = safetensors.torch.load_model(model, checkpoint / WEIGHTS_NAME, strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint} does not match the model: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    return torch.load(checkpoint / STATE_NAME, weights_only=True, map_location="cpu")


@torch.no_grad()
def average_checkpoints(model: nn.Module, checkpoints: list[Path]) -> None:
    """Set `model`'s parameters to the mean of those in `checkpoints` (section 6.1 averaged the last 5 or 20)."""
    if not checkpoints:
        raise ValueError("no checkpoints to average")
    import copy

    scratch = copy.deepcopy(model)
    total = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
    for path in checkpoints:
        safetensors.torch.load_model(scratch, Path(path) / WEIGHTS_NAME, strict=False)
        for name, p in scratch.named_parameters():
            total[name] += p.double()
    for name, p in model.named_parameters():
        p.copy_((total[name] / len(checkpoints)).to(p.dtype))
