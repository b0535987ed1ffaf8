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

from aiayn.config import ModelConfig, check_field_types, fold_old_spelling, parse_overrides, preset
from aiayn.data.readers import decode_text
from aiayn.paths import check_input_file
from aiayn.rundir import load_json
from aiayn.tasks import CAUSAL_LM, OBJECTIVES, SEQ2SEQ, Task, get_task
from aiayn.tokenization import KINDS
from aiayn.training.budget import parse_duration
from aiayn.training.distributed import STRATEGIES
from aiayn.training.schedule import OPTIMIZERS, SCHEDULES

RECIPES = ("auto", "fit", "paper")  # see aiayn.training.recipe
# What a run fixes when it starts, which a resumed run therefore keeps (as it keeps its model): the tokenizers
# trained on its data, its objective, and the encoder it started from.
FIXED_AT_START = ("objective", "tokenizer", "target_tokenizer", "vocab_size", "target_vocab_size", "shared_vocab",
                  "vocab_min_frequency", "lowercase", "init_from")
# Training keys renamed since runs began to save their config, old spelling -> name: a config file, an override
# or an old run's train_config.json may still use the old one, which is read as the new.
OLD_KEYS = {"beam_size": "num_beams", "task": "dataset", "task_train": "dataset_train", "task_valid": "dataset_valid",
            "task_test": "dataset_test", "task_max_number": "dataset_max_number", "task_max_len": "dataset_max_len"}
# The one depth key of a decoder-only language model, whose single stack the model builds as `n_encoder_layers`.
DEPTH_KEY = "n_layers"
# Validation metrics per objective (its task object's); the first is `valid_metric=auto`'s choice.
# Higher is better but for loss.
VALID_METRICS = {name: get_task(name).metrics for name in OBJECTIVES}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs besides the model sizes.

    Attributes:
        objective: one of `aiayn.tasks.OBJECTIVES` (translation, sequence / token classification, masked LM,
            causal LM).
        recipe: "fit" chooses the sizes and rates the config does not set from the corpus (model preset,
            vocabulary, batch tokens, pre-LN, peak lr and warmup, dropout, label smoothing; see
            `aiayn.training.recipe`); "paper" keeps these defaults; "auto": "fit" for translation and
            causal language models from scratch on files (`Task.fits_recipe`), "paper" otherwise.
        dataset: a built-in data set ("numbers", "compare", "copy", "counting"; `aiayn.data.datasets`) instead of
            files; "" to read files. `task`, `task_train`, ... `task_max_len`, the old spellings of `dataset` and
            the `dataset_*` keys below, are read as them from config files, overrides and old runs (`OLD_KEYS`).
        train, valid, test: data files; parallel text may be two aligned files "SRC,TGT".
        data_format: "auto" (from the extension), "tsv", "csv", "jsonl", "text" or "conll".
        source_field, target_field, text_field, label_field: JSONL/CSV field names.
        valid_fraction, test_fraction: seeded split of `train` when `valid`/`test` are not given.
        dataset_train, dataset_valid, dataset_test: split sizes of a built-in data set; dataset_max_number bounds
            its numbers (numbers: 10000, compare: use 1000) and dataset_max_len its copy strings.
        max_source_len, max_target_len: rows with more tokens are dropped (and counted).
        tokenizer: "bpe" (lossless, SentencePiece-style; the default), "unigram", "char", "byte" (UTF-8 bytes),
            "subword-nmt" or "wordpiece" (see `aiayn.tokenization`); `target_tokenizer` sets the target's kind
            when not shared.
        vocab_size, target_vocab_size: tokenizer sizes; shared_vocab: one tokenizer for source and target.
        vocab_min_frequency: least count of a pair for a BPE merge; a small corpus thus gets the smaller
            vocabulary it supports (and a note), not merges learned from single words.
        lowercase: lowercase before tokenizing (the text then does not come back as it went in).
        clean: drop the training pairs the data check flags (duplicates, an empty side, a length ratio
            over 9); they are counted and reported either way.
        max_tokens: padded tokens per batch (before accumulation); max_sentences caps the batch size.
        epochs, max_steps: stop after this many epochs or optimizer steps (0 = no step limit).
        time_budget: wall-clock time for the whole run ("90s", "20m", "1h30m"; "" = none): the trainer
            measures its steps and plans steps, warmup and validation to end within it, the final test
            evaluation included (`aiayn.training.budget`); `epochs` is then ignored and `max_steps` caps.
        accum_steps: batches per optimizer step in each process (gradient accumulation).
        global_batches: batches per optimizer step over all processes; 0 = accum_steps x processes. A run
            fixes it when it starts (train_config.json keeps the number, with accum_steps 1), so a run
            resumed on another number of processes makes the same updates: each process takes
            global_batches / processes of them (rounded up; one with fewer trains an empty batch).
        distributed: under torchrun, "ddp" (every process holds the model, gradients averaged) or "fsdp"
            (parameters, gradients and optimizer state sharded across processes; PyTorch's fully_shard).
        optimizer: "auto", "adam" or "adamw"; schedule: "auto", "noam" (section 5.3), "linear" or "constant".
            "auto" is the paper's Adam and noam from scratch, and AdamW with linear decay when fine-tuning
            (`init_from`); see `aiayn.training.schedule`.
        lr: peak learning rate; 0 = the schedule's own (noam: lr_scale x d_model^-0.5 x warmup^-0.5,
            fine-tuning 3e-5, constant 1e-3). lr_scale multiplies the noam rate.
        warmup: warmup steps; 0 = the paper's 4000, or `warmup_fraction` of the planned steps for a run
            too short for that (with a note; the peak stays the paper's), and `warmup_fraction` of the
            steps for the linear and constant schedules.
        adam_beta1, adam_beta2, adam_eps, weight_decay: optimizer settings; unset (null) takes the
            recipe's: (0.9, 0.98, 1e-9, 0) from scratch, (0.9, 0.999, 1e-8, 0.01) fine-tuning.
        label_smoothing: epsilon_ls (0.1, section 5.4).
        clip_norm: clip the gradient norm to this (0 = off).
        precision: "fp32" or "bf16" (bfloat16 autocast for the forward pass); unset (null): the device's
            choice, bf16 on a CUDA GPU that has it (models at least 512 wide) and on a CPU with native bf16 where a
            step at the model's widths measured faster so, else fp32 (see `aiayn.backends.select`).
        bf16: the old spelling of `precision="bf16"`, so that config files and runs saved before `precision`
            still load; `bf16=true` becomes `precision="bf16"` (and `bf16` false), and is not saved.
        mlm_probability: share of tokens masked for masked-LM (0.15, as BERT).
        lm_examples: what a causal language model trains on: "windows" (its files as documents, a document each
            stretch of text between blank lines, or each line of a file without one; `<s>` document `</s>` after
            one another as one token stream, cut into windows of `max_source_len` tokens: every token is trained
            on), "lines" (one example a line, longer ones dropped), or "auto" (windows from files, lines for the
            built-in data sets, whose examples are sentences).
        seed: seeds the model init, data order, dropout and masking; CPU runs repeat exactly.
        threads: torch CPU threads (0 = torch's default; one a process when `processes` > 1).
        processes: train as this many data-parallel processes on this machine, launched by `aiayn train`
            itself (`aiayn.cli.processes`; as `torchrun --standalone --nproc_per_node N` would): on a CPU, 2
            processes of one thread trained more tokens a second than 2 threads. 1 = one process; 0 (the
            default) = measure, for a CPU run under a time budget of 5 minutes or more, which of threads and
            processes trains faster on the cores it has (`aiayn.training.layout`), else one process.
        log_every: steps between metric log rows; eval_every / save_every: steps between validation
            and checkpoints (0 = at the end of each epoch).
        keep_last: checkpoints kept besides the best; average_last: average the last N checkpoints
            into the final model (0 = off; the paper averaged the last 5 or 20).
        num_beams, length_penalty: decoding for BLEU/exact match at evaluation (`beam_size`, the old
            spelling of `num_beams`, is read as it from config files and overrides: `OLD_KEYS`).
        bleu_tokenize: sacrebleu's tokenizer for BLEU: "auto" ("char" when most references are one word,
            else "13a"), "13a", "intl", "char", "none" or "zh".
        valid_metric: what validation scores, picks the best checkpoint by and stops early on: "auto"
            (seq2seq "bleu", classification "accuracy", tagging "entity_f1", masked-LM "loss"), or
            "chrf", "exact_match", "macro_f1", "loss".
        valid_max_examples: validation generates for at most this many valid examples (0 = all).
        patience: stop after this many validations without a better `valid_metric` (0 = never).
        final_model: "auto", "best", "last" or "average": the saved model is the best validated
            checkpoint, the last step, or the average of the last `average_last` checkpoints
            ("auto": average when average_last > 1, else best).
        show_examples: example translations/predictions printed after the test evaluation.
        init_from: a pretrained encoder directory (aiayn model dir or BERT checkpoint) for classification.
        log_to: "" (metrics.jsonl, metrics.csv and curves.png) or "tensorboard" (those, and TensorBoard event
            files in RUN/tensorboard; needs `pip install tensorboard`).
    """

    objective: str = SEQ2SEQ
    recipe: str = "auto"
    dataset: str = ""
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
    dataset_train: int = 8000
    dataset_valid: int = 500
    dataset_test: int = 500
    dataset_max_number: int = 10000
    dataset_max_len: int = 8
    max_source_len: int = 256
    max_target_len: int = 256
    tokenizer: str = "bpe"
    target_tokenizer: str = ""
    vocab_size: int = 8000
    target_vocab_size: int = 0
    shared_vocab: bool = True
    vocab_min_frequency: int = 2
    lowercase: bool = False
    clean: bool = False
    max_tokens: int = 4096
    max_sentences: int = 0
    epochs: int = 10
    max_steps: int = 0
    time_budget: str = ""
    accum_steps: int = 1
    global_batches: int = 0
    distributed: str = "ddp"
    optimizer: str = "auto"
    schedule: str = "auto"
    lr_scale: float = 1.0
    lr: float = 0.0
    warmup: int = 0
    warmup_fraction: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float | None = None
    adam_eps: float | None = None
    weight_decay: float | None = None
    label_smoothing: float = 0.1
    clip_norm: float = 0.0
    precision: str | None = None
    bf16: bool = False
    mlm_probability: float = 0.15
    lm_examples: str = "auto"
    seed: int = 0
    threads: int = 0
    processes: int = 0
    log_every: int = 10
    eval_every: int = 0
    save_every: int = 0
    keep_last: int = 3
    average_last: int = 0
    num_beams: int = 1
    length_penalty: float = 0.6
    bleu_tokenize: str = "auto"
    valid_metric: str = "auto"
    valid_max_examples: int = 0
    patience: int = 0
    final_model: str = "auto"
    show_examples: int = 5
    init_from: str = ""
    log_to: str = ""

    def __post_init__(self) -> None:
        check_field_types(self, "training")
        if self.bf16:  # the old spelling: one name, `precision`, from here on
            precision = fold_old_spelling("precision", self.precision, "bf16", "bf16", old_shown="true")
            object.__setattr__(self, "precision", precision)
            object.__setattr__(self, "bf16", False)
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        for name, value, choices in (("schedule", self.schedule, SCHEDULES), ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("tokenizer", self.tokenizer, KINDS),
                                     ("target_tokenizer", self.target_tokenizer, ("", *KINDS)),
                                     ("final_model", self.final_model, ("auto", "best", "last", "average")),
                                     ("recipe", self.recipe, RECIPES),
                                     ("distributed", self.distributed, STRATEGIES),
                                     ("precision", self.precision, (None, "fp32", "bf16")),
                                     ("log_to", self.log_to, ("", "tensorboard"))):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(c for c in choices if c)}, got {value!r}")
        metrics = VALID_METRICS[self.objective]
        if self.valid_metric != "auto" and self.valid_metric not in metrics:
            raise ValueError(f"valid_metric for {self.objective} must be auto or one of {', '.join(metrics)}, "
                             f"got {self.valid_metric!r}")
        for name in ("max_tokens", "accum_steps", "vocab_size", "vocab_min_frequency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("epochs", "max_steps", "keep_last", "average_last", "log_every", "eval_every",
                     "save_every", "threads", "processes", "max_sentences", "valid_max_examples", "patience",
                     "show_examples", "lr", "weight_decay", "warmup", "global_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.global_batches and self.accum_steps > 1:
            raise ValueError(f"accum_steps={self.accum_steps} and global_batches={self.global_batches} both size the "
                             "step: global_batches counts the batches of a step over all processes, accum_steps "
                             "those of each process (a run keeps global_batches in its train_config.json); keep one")
        if not 0.0 < self.warmup_fraction <= 1.0:
            raise ValueError(f"warmup_fraction must be in (0, 1], got {self.warmup_fraction}")
        if self.time_budget:
            parse_duration(self.time_budget)
        elif self.epochs == 0 and self.max_steps == 0:
            raise ValueError("set epochs, max_steps or time_budget above 0")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {self.mlm_probability}")
        if self.lm_examples not in ("auto", "windows", "lines"):
            raise ValueError(f"lm_examples must be one of auto, windows, lines; got {self.lm_examples!r}")
        if self.bleu_tokenize not in ("auto", "13a", "intl", "char", "none", "zh"):
            raise ValueError(f"bleu_tokenize must be one of auto, 13a, intl, char, none, zh; "
                             f"got {self.bleu_tokenize!r}")
        if not self.dataset and not self.train:
            raise ValueError("give a built-in data set (dataset=numbers|compare|copy|counting) or a train file "
                             "(train=PATH)")
        files = [f"{name}={getattr(self, name)}" for name in ("train", "valid", "test") if getattr(self, name)]
        if self.dataset and files:
            raise ValueError(f"dataset={self.dataset} makes its own data but {' '.join(files)} names files too: "
                             "keep one source (drop dataset= or the files)")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field but `bf16` (always false once built: `precision` holds it)."""
        return {name: value for name, value in dataclasses.asdict(self).items() if name != "bf16"}

    @property
    def objective_task(self) -> Task:
        """The task object of `objective` (`aiayn.tasks`) with this config's options for it (`mlm_probability`): what
        reading, encoding and training do differently."""
        return get_task(self.objective).configured(self)

    @property
    def metric(self) -> str:
        """The validation metric `valid_metric` names ("auto" resolved for the objective)."""
        return VALID_METRICS[self.objective][0] if self.valid_metric == "auto" else self.valid_metric


@dataclass(frozen=True)
class RunConfig:
    """A training config plus the model's preset and overrides, as a config file describes them.

    `given` names the keys the file and the overrides set (training keys, and "model.KEY" for model keys):
    a fitted recipe (`aiayn.training.recipe`) chooses only the others. It is not saved with the config.
    """

    train: TrainConfig
    model_preset: str = "tiny"
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    given: frozenset[str] = dataclasses.field(default_factory=frozenset, compare=False)

    def model_config(self, **derived: Any) -> ModelConfig:
        """The preset with the file's overrides, then the sizes derived from the data (`derived`)."""
        return preset(self.model_preset).replace(**{**self.model_overrides, **derived})

    def to_dict(self) -> dict[str, Any]:
        """The config as a file would hold it."""
        return {**self.train.to_dict(), "model": {"preset": self.model_preset, **self.model_overrides}}


def example_config(name: str) -> Path:
    """The path of a shipped example config, `examples/NAME.toml` (inside the package as `aiayn/examples`)."""
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.toml"))
        raise FileNotFoundError(f"no example config {name!r}; the examples are: {', '.join(known)}")
    return path


def _read_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"config file {path} is a directory; give a .toml or .json file")
    check_input_file(path, "config file", stream=True)  # a pipe (`<(cat run.toml)`) is read as a file is
    with open(path, "rb") as handle:  # once: a pipe gives its bytes once
        text = decode_text(handle.read(), str(path))
    is_pipe = path.suffix.lower() not in (".json", ".toml") and not path.is_file()
    if path.suffix.lower() == ".json" or (is_pipe and text.lstrip().startswith(("{", "["))):
        try:
            return load_json(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if path.suffix.lower() != ".toml" and not is_pipe:
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


def _stack_depth(value: str, objective: str, model: dict[str, Any]) -> dict[str, Any]:
    """`model.n_layers`, the depth of a decoder-only language model's one stack, as the model key that holds it
    (`n_encoder_layers`: the stack a causal model runs is built where an encoder's layers are). Another objective has
    two stacks or an encoder's, named by their own keys: ValueError naming them."""
    if objective != CAUSAL_LM:
        raise ValueError(f"model.{DEPTH_KEY} is the depth of a decoder-only language model (objective=causal_lm); "
                         f"objective={objective} sets its depth with model.n_encoder_layers (and a decoder's with "
                         "model.n_decoder_layers)")
    try:
        depth = parse_overrides([f"n_encoder_layers={value}"], ModelConfig)["n_encoder_layers"]
    except ValueError:
        raise ValueError(f"model.{DEPTH_KEY} expects an integer, got {value!r}") from None
    if model.get("n_encoder_layers", depth) != depth:
        raise ValueError(f"model.{DEPTH_KEY}={depth} and model.n_encoder_layers={model['n_encoder_layers']} both "
                         f"set the language model's depth: keep model.{DEPTH_KEY}")
    return {"n_encoder_layers": depth}


def _new_keys(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each old key (`OLD_KEYS`) read as its new name; both given and different: ValueError."""
    values = dict(values)
    for old, new in OLD_KEYS.items():
        if old in values:
            values[new] = fold_old_spelling(new, values.get(new), old, values.pop(old))
    return values


def _build_run_config(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> RunConfig:
    model = data.pop("model", None) or {}
    if not isinstance(model, dict):
        raise ValueError(f"'model' must be a table of model keys, got {type(model).__name__}")
    model = dict(model)
    preset_given = "preset" in model
    model_preset = model.pop("preset", "tiny")
    if not isinstance(model_preset, str):
        raise ValueError(f"model key preset must be a string, got {model_preset!r}")
    preset(model_preset)  # validates the name
    train = _typed(_new_keys(data), TrainConfig, "training")  # the file's keys, then the overrides
    train_items = [item for item in overrides if not item.strip().startswith("model.")]
    model_items = [item.strip()[len("model."):] for item in overrides if item.strip().startswith("model.")]
    depth = [item for item in model_items if item.split("=", 1)[0].strip() == DEPTH_KEY]
    model_items = [item for item in model_items if item not in depth]
    if DEPTH_KEY in model:
        depth.insert(0, f"{DEPTH_KEY}={model.pop(DEPTH_KEY)}")
    model = _typed(model, ModelConfig, "model")
    preset_items = [item for item in model_items if item.split("=", 1)[0].strip() == "preset"]
    if preset_items:
        model_preset = preset_items[-1].split("=", 1)[1].strip()
        preset(model_preset)
        model_items = [item for item in model_items if item not in preset_items]
    train.update(_new_keys(parse_overrides(train_items, TrainConfig, OLD_KEYS)))
    model.update(parse_overrides(model_items, ModelConfig))
    if depth:
        objective = train.get("objective", SEQ2SEQ)  # the file's, then the overrides' (applied above)
        model.update(_stack_depth(depth[-1].split("=", 1)[1].strip(), objective, model))
    given = {*train, *(f"model.{key}" for key in model)} | ({"model.preset"} if preset_items or preset_given else set())
    run = RunConfig(TrainConfig(**train), model_preset, model, frozenset(given))
    run.model_config(vocab_size=max(run.train.vocab_size, 8))  # validate the model keys early
    return run
