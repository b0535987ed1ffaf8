"""Saving and loading models: weights as safetensors plus the config as JSON (and the tokenizer).

A model directory holds `config.json`, `model.safetensors` and, when saved with one,
`tokenizer.json` (plus `tokenizer_meta.json` naming its special tokens). Nothing is unpickled.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.nn.model import build_model
from aiayn.nn.sizes import check_model_fits
from aiayn.paths import check_input_file
from aiayn.rundir import MODEL_CONFIG as CONFIG_NAME
from aiayn.rundir import (
    SOURCE_TOKENIZER,
    TARGET_TOKENIZER,
    atomic_output,
    atomic_write_bytes,
    checkpoint_run,
    load_json,
    no_model_hint,
)
from aiayn.rundir import WEIGHTS as WEIGHTS_NAME
from aiayn.weights import check_layer_counts, load_weights

if TYPE_CHECKING:
    from aiayn.tokenization import Tokenizer

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "atomic_write_bytes", "load_config", "load_model", "load_tokenizers",
           "save_model"]


def save_model(model: nn.Module, directory: str | Path, *, tokenizer: Tokenizer | None = None) -> Path:
    """Save `model` (its `.config`, weights and optional tokenizer) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = model.config
    # save_model (not save_file) de-duplicates tied weights (embedding = output projection).
    with atomic_output(directory / WEIGHTS_NAME) as tmp:
        safetensors.torch.save_model(model, str(tmp), metadata={"format": "pt", "aiayn": "1"})
    atomic_write_bytes(directory / CONFIG_NAME, (cfg.to_json() + "\n").encode())
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory


def load_config(directory: str | Path) -> ModelConfig:
    """Read `config.json` from a model directory; every key must be there (a default could decode differently)."""
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not directory.is_dir():
        hint = no_model_hint(directory) if directory.exists() else None  # a checkpoint pointer names its step
        raise (NotADirectoryError if directory.exists() else FileNotFoundError)(
            hint or f"{directory} is not an aiayn model directory "
                     f"({'a file, not a directory' if directory.exists() else 'no such directory'})")
    if not path.is_file():
        if path.exists() or path.is_symlink():
            check_input_file(path, "model config")  # a device, a link loop: said so
        hint = no_model_hint(directory)  # the run's checkpoints, a run that did not finish
        if hint is not None:
            raise FileNotFoundError(hint)
        raise FileNotFoundError(f"{directory} is not an aiayn model directory: {CONFIG_NAME} is missing")
    try:
        data = load_json(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of model settings, got {type(data).__name__}")
    if "model_type" in data:
        raise ValueError(f"{directory} holds a Hugging Face checkpoint (model_type {data['model_type']!r}), "
                         "not an aiayn model; aiayn.load(path) reads BERT-family checkpoints and every aiayn directory")
    missing = sorted({f.name for f in fields(ModelConfig)} - set(data))
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; a saved model names every setting (a default could "
                         "differ from what it was trained with): add them or save the model again")
    try:
        return ModelConfig.from_dict(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def load_model(directory: str | Path) -> nn.Module:
    """Build the model from `config.json` and load `model.safetensors` into it (eval mode).

    The weights are checked key by key first (missing, unexpected, shapes, NaN/Inf): see `aiayn.weights`.
    """
    directory = Path(directory)
    cfg = load_config(directory)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file() and not weights.exists() and not weights.is_symlink():
        raise FileNotFoundError(f"{directory}: {WEIGHTS_NAME} is missing")
    if weights.is_dir():
        raise IsADirectoryError(f"{weights} is a directory; a safetensors weights file belongs there")
    check_input_file(weights, "weights file")  # a device, a link loop or a dangling link: said so
    # the model and the file's tensors are in memory together while the weights are copied in
    check_model_fits(cfg, extra=weights.stat().st_size, what=f"the model in {directory}")
    # before building them; a decoder-only model keeps its n_encoder_layers layers under "decoder."
    stacks = (0, cfg.n_encoder_layers) if cfg.causal else (cfg.n_encoder_layers, cfg.n_decoder_layers)
    check_layer_counts(weights, *stacks)
    return load_weights(build_model(cfg), weights).eval()


def load_tokenizers(directory: str | Path) -> tuple[Tokenizer, Tokenizer]:
    """(source, target) tokenizers of a model directory.

    One shared `tokenizer.json` at the top serves both; separate vocabularies live in
    `source/tokenizer.json` and `target/tokenizer.json`.
    """
    from aiayn.tokenization import TOKENIZER_NAME, Tokenizer

    directory = Path(directory)
    run = checkpoint_run(directory)
    if run is not None and not (directory / TOKENIZER_NAME).exists():  # a checkpoint: the run holds its tokenizer
        return load_tokenizers(run)
    shared_file = directory / TOKENIZER_NAME
    if shared_file.exists() or shared_file.is_symlink():  # Tokenizer.load says what is wrong with it
        shared = Tokenizer.load(directory)
        return shared, shared
    source, target = directory / SOURCE_TOKENIZER, directory / TARGET_TOKENIZER
    if (source / TOKENIZER_NAME).is_file() and (target / TOKENIZER_NAME).is_file():
        return Tokenizer.load(source), Tokenizer.load(target)
    raise FileNotFoundError(f"{directory}: no {TOKENIZER_NAME} (nor source/ and target/ tokenizers)")
