"""Training configuration: one dataclass with the paper's recipe as defaults, read from TOML or JSON.

A config file holds training keys at the top level and model keys in a `[model]` table
(`preset` plus any `ModelConfig` field). `key=value` overrides follow, `model.KEY=value` for the model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from aiayn.config import ModelConfig, check_field_types, parse_overrides, preset

OBJECTIVES = ("seq2seq", "sequence_classification", "token_classification", "masked_lm")
SCHEDULES = ("noam", "constant")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs besides the model sizes.

    Attributes:
        objective: "seq2seq", "sequence_classification", "token_classification" or "masked_lm".
        task: a built-in task ("numbers", "compare", "copy") instead of files; "" to read files.
        train, valid, test: data files; parallel text may be two aligned files "SRC,TGT".
        data_format: "auto" (from the extension), "tsv", "csv", "jsonl", "text" or "conll".
        source_field, target_field, text_field, label_field: JSONL/CSV field names.
        valid_fraction, test_fraction: seeded split of `train` when `valid`/`test` are not given.
        task_train, task_valid, task_test: split sizes of a built-in task; task_max_number bounds its
            numbers (numbers: 10000, compare: use 1000) and task_max_len its copy strings.
        max_source_len, max_target_len: rows with more tokens are dropped (and counted).
        tokenizer: "bpe", "wordpiece" or "char"; `target_tokenizer` sets the target's kind when not shared.
        vocab_size, target_vocab_size: tokenizer sizes; shared_vocab: one tokenizer for source and target.
        lowercase: lowercase and strip accents before tokenizing.
        max_tokens: padded tokens per batch (before accumulation); max_sentences caps the batch size.
        epochs, max_steps: stop after this many epochs or optimizer steps (0 = no step limit).
        accum_steps: batches per optimizer step (gradient accumulation).
        schedule: "noam" (section 5.3) or "constant"; lr_scale multiplies the noam rate; lr is the constant rate.
        warmup: warmup steps of the noam schedule (4000 in the paper).
        adam_beta1, adam_beta2, adam_eps, weight_decay: Adam settings (0.9, 0.98, 1e-9 in the paper).
        label_smoothing: epsilon_ls (0.1, section 5.4).
        clip_norm: clip the gradient norm to this (0 = off).
        bf16: bfloat16 autocast for the forward pass.
        mlm_probability: share of tokens masked for masked-LM (0.15, as BERT).
        seed: seeds the model init, data order, dropout and masking; CPU runs repeat exactly.
        threads: torch CPU threads (0 = torch's default).
        log_every: steps between metric log rows; eval_every / save_every: steps between validation
            and checkpoints (0 = at the end of each epoch).
        keep_last: checkpoints kept besides the best; average_last: average the last N checkpoints
            into the final model (0 = off; the paper averaged the last 5 or 20).
        beam_size, length_penalty: decoding for BLEU/exact match at evaluation.
        bleu_tokenize: sacrebleu's tokenizer for BLEU: "13a" (default) or "char" (one-word targets).
        eval_max_batches: cap on decoded batches when validating during training (0 = all).
        show_examples: example translations/predictions printed after the test evaluation.
        init_from: a pretrained encoder directory (aiayn model dir or BERT checkpoint) for classification.
    """

    objective: str = "seq2seq"
    task: str = ""
    train: str = ""
    valid: str = ""
    test: str = ""
    data_format: str = "auto"
    source_field: str = "source"
    target_field: str = "target"
    text_field: str = "text"
    label_field: str = "label"
    valid_fraction: float = 0.05
    test_fraction: float = 0.05
    task_train: int = 8000
    task_valid: int = 500
    task_test: int = 500
    task_max_number: int = 10000
    task_max_len: int = 8
    max_source_len: int = 256
    max_target_len: int = 256
    tokenizer: str = "bpe"
    target_tokenizer: str = ""
    vocab_size: int = 8000
    target_vocab_size: int = 0
    shared_vocab: bool = True
    lowercase: bool = False
    max_tokens: int = 4096
    max_sentences: int = 0
    epochs: int = 10
    max_steps: int = 0
    accum_steps: int = 1
    schedule: str = "noam"
    lr_scale: float = 1.0
    lr: float = 1e-3
    warmup: int = 4000
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 0.0
    bf16: bool = False
    mlm_probability: float = 0.15
    seed: int = 0
    threads: int = 0
    log_every: int = 10
    eval_every: int = 0
    save_every: int = 0
    keep_last: int = 3
    average_last: int = 0
    beam_size: int = 1
    length_penalty: float = 0.6
    bleu_tokenize: str = "13a"
    eval_max_batches: int = 0
    show_examples: int = 5
    init_from: str = ""

    def __post_init__(self) -> None:
        check_field_types(self, "training")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for name in ("max_tokens", "accum_steps", "warmup", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("epochs", "max_steps", "keep_last", "average_last", "log_every", "eval_every",
                     "save_every", "threads", "max_sentences", "eval_max_batches", "show_examples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.epochs == 0 and self.max_steps == 0:
            raise ValueError("set epochs or max_steps above 0")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {self.mlm_probability}")
        if self.bleu_tokenize not in ("13a", "intl", "char", "none", "zh"):
            raise ValueError(f"bleu_tokenize must be one of 13a, intl, char, none, zh; got {self.bleu_tokenize!r}")
        if not self.task and not self.train:
            raise ValueError("give a built-in task (task=numbers|compare|copy) or a train file (train=PATH)")
        files = [f"{name}={getattr(self, name)}" for name in ("train", "valid", "test") if getattr(self, name)]
        if self.task and files:
            raise ValueError(f"task={self.task} makes its own data but {' '.join(files)} names files too: "
                             "keep one source (drop task= or the files)")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunConfig:
    """A training config plus the model's preset and overrides, as a config file describes them."""

    train: TrainConfig
    model_preset: str = "tiny"
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def model_config(self, **derived: Any) -> ModelConfig:
        """The preset with the file's overrides, then the sizes derived from the data (`derived`)."""
        return preset(self.model_preset).replace(**{**self.model_overrides, **derived})

    def to_dict(self) -> dict[str, Any]:
        """The config as a file would hold it."""
        return {**self.train.to_dict(), "model": {"preset": self.model_preset, **self.model_overrides}}


def _read_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"config file {path} is a directory; give a .toml or .json file")
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if path.suffix.lower() != ".toml":
        raise ValueError(f"config file {path} must end in .toml or .json")
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ValueError(f"reading {path} needs Python 3.11+ or the 'tomli' package; "
                             "pip install tomli, or use a .json config") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: invalid TOML ({err})") from None


def _typed(data: dict[str, Any], cls: type, where: str) -> dict[str, Any]:
    """Check keys of `data` against `cls`'s fields (their types are checked when the dataclass is built)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {where} key(s): {', '.join(unknown)}")
    return dict(data)


def load_run_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                    base: dict[str, Any] | None = None) -> RunConfig:
    """Read a TOML/JSON config (or start from `base`), then apply `key=value` / `model.key=value` overrides.

    Values are type-checked the same way whatever their source; an error from the file's values names the file.
    """
    data = dict(base or {})
    if path:
        content = _read_file(path)
        if not isinstance(content, dict):
            raise ValueError(f"{path}: expected an object of training keys (and a model table), "
                             f"got {type(content).__name__}")
        data.update(content)
    try:
        return _build_run_config(dict(data), overrides)
    except ValueError as err:
        if path and _problem(data) == str(err):  # the file's own values are wrong: name the file
            raise ValueError(f"{path}: {err}") from None
        raise


def _problem(data: dict[str, Any]) -> str:
    try:
        _build_run_config(dict(data), ())
    except ValueError as err:
        return str(err)
    return ""


def _build_run_config(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> RunConfig:
    model = data.pop("model", None) or {}
    if not isinstance(model, dict):
        raise ValueError(f"'model' must be a table of model keys, got {type(model).__name__}")
    model = dict(model)
    model_preset = model.pop("preset", "tiny")
    if not isinstance(model_preset, str):
        raise ValueError(f"model key preset must be a string, got {model_preset!r}")
    preset(model_preset)  # validates the name
    model = _typed(model, ModelConfig, "model")
    train = _typed(data, TrainConfig, "training")
    train_items = [item for item in overrides if not item.strip().startswith("model.")]
    model_items = [item.strip()[len("model."):] for item in overrides if item.strip().startswith("model.")]
    preset_items = [item for item in model_items if item.split("=", 1)[0].strip() == "preset"]
    if preset_items:
        model_preset = preset_items[-1].split("=", 1)[1].strip()
        preset(model_preset)
        model_items = [item for item in model_items if item not in preset_items]
    train.update(parse_overrides(train_items, TrainConfig))
    model.update(parse_overrides(model_items, ModelConfig))
    run = RunConfig(TrainConfig(**train), model_preset, model)
    run.model_config(vocab_size=max(run.train.vocab_size, 8))  # validate the model keys early
    return run
