"""Saving and loading models: weights as safetensors plus the config as JSON (and the tokenizer).

A model directory holds `config.json`, `model.safetensors` and, when saved with one,
`tokenizer.json` (plus `tokenizer_meta.json` naming its special tokens). Nothing is unpickled.

The weights' metadata records a digest of the tokenizer files the model reads (`tokenizer_sha256`: its own
directory's, or its run's for a checkpoint); `load_tokenizers` refuses a tokenizer whose files differ from the ones
the model was saved with (another run's `tokenizer.json` of the same size decodes garbage without an error).
"""

from __future__ import annotations

import hashlib
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


def save_model(model: nn.Module, directory: str | Path, *, tokenizer: Tokenizer | None = None,
               tokenizers_in: str | Path | None = None) -> Path:
    """Save `model` (its `.config`, weights and optional tokenizer) into `directory`; the weights record the digest
    of the tokenizer files in `directory` (or in `tokenizers_in`: a checkpoint's run), where there are any."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = model.config
    if tokenizer is not None:
        tokenizer.save(directory)
    metadata = {"format": "pt", "aiayn": "1"}
    digest = tokenizer_digest(tokenizers_in or directory)
    if digest is not None:
        metadata[DIGEST_KEY] = digest
    # save_model (not save_file) de-duplicates tied weights (embedding = output projection).
    with atomic_output(directory / WEIGHTS_NAME) as tmp:
        safetensors.torch.save_model(model, str(tmp), metadata=metadata)
    atomic_write_bytes(directory / CONFIG_NAME, (cfg.to_json() + "\n").encode())
    return directory


DIGEST_KEY = "tokenizer_sha256"


def _tokenizer_files(directory: Path) -> list[Path]:
    """The tokenizer files a model in `directory` reads: one shared `tokenizer.json`, or the source's and target's."""
    from aiayn.tokenization import TOKENIZER_NAME

    if (directory / TOKENIZER_NAME).is_file():
        return [directory / TOKENIZER_NAME]
    pair = [directory / SOURCE_TOKENIZER / TOKENIZER_NAME, directory / TARGET_TOKENIZER / TOKENIZER_NAME]
    return pair if all(path.is_file() for path in pair) else []


def tokenizer_digest(directory: str | Path) -> str | None:
    """The sha256 of the tokenizer files in `directory` (None: none there)."""
    files = _tokenizer_files(Path(directory))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _recorded_digest(directory: Path) -> str | None:
    """The tokenizer digest the weights in `directory` recorded (None: none, or weights it cannot read: loading them
    says why)."""
    try:
        with safetensors.safe_open(str(directory / WEIGHTS_NAME), "pt") as weights:
            return (weights.metadata() or {}).get(DIGEST_KEY)
    except Exception:  # noqa: BLE001 (damaged or missing weights: `load_model` names the problem)
        return None


def check_tokenizer_digest(model_dir: Path, tokenizer_dir: Path) -> None:
    """ValueError when the tokenizer files in `tokenizer_dir` are not the ones `model_dir`'s weights were saved with."""
    recorded = _recorded_digest(model_dir)
    found = tokenizer_digest(tokenizer_dir) if recorded else None
    if recorded and found and recorded != found:
        names = ", ".join(str(path) for path in _tokenizer_files(tokenizer_dir))
        raise ValueError(f"{names} is not the tokenizer {model_dir}'s weights were saved with (they record sha256 "
                         f"{recorded[:16]}..., the file has {found[:16]}...): put the model's own tokenizer back, "
                         "or train a model on this one")


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
    # a checkpoint: the run holds its tokenizer
    where = run if run is not None and not (directory / TOKENIZER_NAME).exists() else directory
    shared_file = where / TOKENIZER_NAME
    source, target = where / SOURCE_TOKENIZER, where / TARGET_TOKENIZER
    if shared_file.exists() or shared_file.is_symlink():  # Tokenizer.load says what is wrong with it
        shared = Tokenizer.load(where)
        tokenizers = shared, shared
    elif (source / TOKENIZER_NAME).is_file() and (target / TOKENIZER_NAME).is_file():
        tokenizers = Tokenizer.load(source), Tokenizer.load(target)
    else:
        raise FileNotFoundError(f"{where}: no {TOKENIZER_NAME} (nor source/ and target/ tokenizers)")
    check_tokenizer_digest(directory, where)  # readable, but the one the weights were saved with?
    return tokenizers
