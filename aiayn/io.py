"""Saving and loading models: weights as safetensors plus the config as JSON (and the tokenizer).

A model directory holds `config.json`, `model.safetensors` and, when saved with one,
`tokenizer.json` (plus `tokenizer_meta.json` naming its special tokens). Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.nn.model import build_model

if TYPE_CHECKING:
    from aiayn.tokenization import Tokenizer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_model(model: nn.Module, directory: str | Path, *, tokenizer: Tokenizer | None = None) -> Path:
    """Save `model` (its `.config`, weights and optional tokenizer) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = model.config
    # save_model (not save_file) de-duplicates tied weights (embedding = output projection).
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{WEIGHTS_NAME}.", suffix=".tmp")
    os.close(fd)
    try:
        safetensors.torch.save_model(model, tmp, metadata={"format": "pt", "aiayn": "1"})
        os.replace(tmp, directory / WEIGHTS_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    atomic_write_bytes(directory / CONFIG_NAME, (cfg.to_json() + "\n").encode())
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory


def load_config(directory: str | Path) -> ModelConfig:
    """Read `config.json` from a model directory."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not an aiayn model directory: {CONFIG_NAME} is missing")
    try:
        return ModelConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def load_model(directory: str | Path, *, strict: bool = True) -> nn.Module:
    """Build the model from `config.json` and load `model.safetensors` into it (eval mode)."""
    directory = Path(directory)
    cfg = load_config(directory)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{directory}: {WEIGHTS_NAME} is missing")
    model = build_model(cfg)
    missing, unexpected = safetensors.torch.load_model(model, weights, strict=False)
    if strict and (missing or unexpected):
        raise ValueError(
            f"{weights} does not match its config: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    return model.eval()


def load_tokenizers(directory: str | Path) -> tuple[Tokenizer, Tokenizer]:
    """(source, target) tokenizers of a model directory.

    One shared `tokenizer.json` at the top serves both; separate vocabularies live in
    `source/tokenizer.json` and `target/tokenizer.json`.
    """
    from aiayn.tokenization import TOKENIZER_NAME, Tokenizer

    directory = Path(directory)
    if (directory / TOKENIZER_NAME).is_file():
        shared = Tokenizer.load(directory)
        return shared, shared
    if (directory / "source" / TOKENIZER_NAME).is_file() and (directory / "target" / TOKENIZER_NAME).is_file():
        return Tokenizer.load(directory / "source"), Tokenizer.load(directory / "target")
    raise FileNotFoundError(f"{directory}: no {TOKENIZER_NAME} (nor source/ and target/ tokenizers)")
