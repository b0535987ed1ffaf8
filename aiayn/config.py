"""Model configuration: one frozen dataclass with the paper's defaults, presets and validation.

Modules receive plain numbers: `aiayn.nn.model.build_model` reads a `ModelConfig` to wire them, and the built
model keeps it as `model.config` (what saving, loading, generation and interop read).
Every deviation from "Attention Is All You Need" (Vaswani et al., 2017) is a named field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from aiayn.rundir import atomic_write_text, load_json
from aiayn.tasks.names import ENCODER_OBJECTIVES, LABELLED, MASKED_LM

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
POSITIONALS = ("sinusoidal", "learned", "none")
PE_LAYOUTS = ("interleaved", "split")
HEADS = ("none", *ENCODER_OBJECTIVES)  # an encoder-only objective names its head
POOLINGS = ("first", "mean")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and options of a Transformer; defaults are the paper's base model (section 3, Table 3).

    Attributes:
        vocab_size: source vocabulary size (shared with the target unless `tgt_vocab_size` is set).
        tgt_vocab_size: target vocabulary size; None means one shared vocabulary (section 3.4).
        d_model: width of every sub-layer output (512).
        n_heads: attention heads h (8); d_k = d_v = d_model / h.
        d_ff: inner width of the position-wise feed-forward network (2048).
        n_encoder_layers: N for the encoder (6).
        n_decoder_layers: N for the decoder (6); 0 builds an encoder-only model.
        dropout: P_drop on sub-layer outputs and on embedding + positions (0.1, section 5.4).
        attention_dropout: dropout on attention weights (not used in the paper, so 0.0).
        activation_dropout: dropout on the feed-forward hidden layer (not in the paper, so 0.0).
        activation: "relu" (paper), "gelu" (BERT) or "gelu_tanh".
        norm_first: False is the paper's post-LN `LayerNorm(x + Sublayer(x))`; True is pre-LN,
            which also adds a final LayerNorm after each stack.
        layer_norm_eps: epsilon of every LayerNorm.
        positional: "sinusoidal" (section 3.5), "learned" (BERT) or "none".
        pe_layout: "interleaved" (sin on even, cos on odd dims, the paper's formula) or "split"
            (sin half then cos half, as tensor2tensor, Marian and fairseq store it).
        max_len: most positions a model accepts (learned positions need a table this long).
        scale_embeddings: multiply token embeddings by sqrt(d_model) (section 3.4).
        tie_embeddings: the pre-softmax projection shares the target embedding matrix (section 3.4).
        share_embeddings: source and target share one embedding matrix (needs one vocabulary).
        bias: biases in attention projections and feed-forward layers.
        pad_id: padding token id; padded keys are never attended to.
        type_vocab_size: BERT token-type (segment) embeddings; 0 disables them.
        embedding_norm: LayerNorm on the embedding sum (BERT).
        head: encoder-only output head: "none" (hidden states) or an encoder objective's name
            (`aiayn.tasks.ENCODER_OBJECTIVES`: sequence / token classification, masked LM).
        num_labels: classes of a classification head.
        pooling: sequence-classification pooling, "first" token or "mean" over real tokens.
        causal: the decoder-only language model (GPT): the stack's self-attention sees only earlier
            positions and a vocabulary head predicts each next token; the paper's decoder without
            cross-attention. Needs `n_decoder_layers=0` and `head="none"`.
    """

    vocab_size: int = 37000
    tgt_vocab_size: int | None = None
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    activation: str = "relu"
    norm_first: bool = False
    layer_norm_eps: float = 1e-5
    positional: str = "sinusoidal"
    pe_layout: str = "interleaved"
    max_len: int = 1024
    scale_embeddings: bool = True
    tie_embeddings: bool = True
    share_embeddings: bool = True
    bias: bool = True
    pad_id: int = 0
    type_vocab_size: int = 0
    embedding_norm: bool = False
    head: str = "none"
    num_labels: int = 0
    pooling: str = "first"
    causal: bool = False

    def __post_init__(self) -> None:
        self.validate()

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def d_k(self) -> int:
        """Per-head width d_k = d_model / n_heads."""
        return self.d_model // self.n_heads

    @property
    def target_vocab_size(self) -> int:
        """The decoder's vocabulary size (the shared one unless set apart)."""
        return self.vocab_size if self.tgt_vocab_size is None else self.tgt_vocab_size

    @property
    def architecture(self) -> str:
        """"encoder-decoder", "encoder-only" or "decoder-only" (`causal`): the shape `build_model` gives."""
        return "decoder-only" if self.causal else "encoder-decoder" if self.n_decoder_layers else "encoder-only"

    @property
    def projects_to_vocabulary(self) -> bool:
        """True when the model ends in a projection onto its vocabulary: a decoder's (encoder-decoder or
        decoder-only) or a masked-LM head's. An encoder giving hidden states or labels has none."""
        return self.causal or self.n_decoder_layers > 0 or self.head == MASKED_LM

    @property
    def has_cross_attention(self) -> bool:
        """True when the model has decoder layers that attend to an encoder's output (the paper's
        "encoder-decoder attention", section 3.2.3): it reads a source sequence. A decoder-only model (`causal`)
        has none."""
        return self.n_decoder_layers > 0

    # -- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        _check_finite(self)
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "n_encoder_layers", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_decoder_layers", "type_vocab_size", "num_labels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.tgt_vocab_size is not None and (
            not isinstance(self.tgt_vocab_size, int) or isinstance(self.tgt_vocab_size, bool)
            or self.tgt_vocab_size <= 0
        ):
            raise ValueError(f"tgt_vocab_size must be a positive integer or null, got {self.tgt_vocab_size!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if not _is_number(value) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if not _is_number(self.layer_norm_eps) or self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps!r}")
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("positional", self.positional, POSITIONALS)
        _check_choice("pe_layout", self.pe_layout, PE_LAYOUTS)
        _check_choice("head", self.head, HEADS)
        _check_choice("pooling", self.pooling, POOLINGS)
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id {self.pad_id} is outside the vocabulary (size {self.vocab_size})")
        if self.share_embeddings and self.has_cross_attention and self.target_vocab_size != self.vocab_size:
            raise ValueError(
                "share_embeddings needs one vocabulary: set tgt_vocab_size to null "
                "or share_embeddings=false"
            )
        if self.head != "none" and self.n_decoder_layers and not self.causal:  # an encoder-decoder has no such head
            raise ValueError(f"head {self.head!r} sits on an encoder: set n_decoder_layers=0 (an encoder-decoder's "
                             f"head is its vocabulary projection; it has {self.n_decoder_layers} decoder layers)")
        if self.head in LABELLED and self.num_labels < 1:
            raise ValueError(f"head {self.head!r} needs num_labels >= 1")
        for name in ("norm_first", "scale_embeddings", "tie_embeddings", "share_embeddings",
                     "bias", "embedding_norm", "causal"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.causal and (self.n_decoder_layers or self.head != "none"):
            raise ValueError("causal (a decoder-only language model) needs n_decoder_layers=0 and head=none, got "
                             f"n_decoder_layers={self.n_decoder_layers}, head={self.head!r}")
        check_field_types(self, "model")  # what the checks above do not cover

    # -- round trips ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict, rejecting unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config key(s): {', '.join(unknown)}")
        return cls(**data)

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialise to JSON; also write it to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            atomic_write_text(path, text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> ModelConfig:
        """Load from a JSON file path or a JSON string."""
        text, where = str(source), "the config"
        if not text.lstrip().startswith("{"):
            text, where = Path(source).read_text(encoding="utf-8"), str(source)
        try:
            data = load_json(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object of model settings, got {type(data).__name__}")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown config key(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: list[str] | tuple[str, ...]) -> ModelConfig:
        """Apply CLI-style `key=value` overrides, parsing each value to the field's type."""
        return self.replace(**parse_overrides(overrides, type(self)))


_TYPE_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}


MAX_INT = 2**63 - 1  # the largest count a setting may hold (torch's and numpy's int64)


def fold_old_spelling(name: str, value: Any, old_name: str, old_value: Any, *, old_shown: str | None = None) -> Any:
    """The value of setting `name`, given as `value` or under its old spelling `old_name` (`old_value`, None
    when not given, already in the new setting's terms), so that config files and code written before a
    rename still run. Both given and different: ValueError naming both (`old_shown`: how the old one was
    written, when not `old_value`)."""
    if old_value is None:
        return value
    if value not in (None, old_value):
        raise ValueError(f"{old_name}={old_shown or old_value} and {name}={value} disagree: keep {name} "
                         f"({old_name} is its old spelling)")
    return old_value


def check_field_types(instance: Any, where: str) -> None:
    """Raise ValueError when a dataclass field holds a value of the wrong type, whatever source it came from.

    The one check of every numeric setting's kind: a string where a bool belongs ("false" in a JSON file)
    would otherwise count as true, True where an integer belongs would count as 1; an integer is accepted
    where a float belongs, but never NaN or Inf, and no integer beyond int64. `where` ("model", "training",
    "decoding") starts the message; each dataclass then checks its ranges.
    """
    for f in fields(instance):
        value = getattr(instance, f.name)
        type_name = str(f.type).replace(" ", "")
        if value is None and type_name.endswith("|None"):
            continue
        base = type_name.removesuffix("|None")
        ok = {"bool": isinstance(value, bool), "int": isinstance(value, int) and not isinstance(value, bool),
              "float": _is_number(value), "str": isinstance(value, str)}.get(base, True)
        if not ok:
            expected = _TYPE_WORDS[base] + (" or null" if type_name.endswith("|None") else "")
            raise ValueError(f"{where} key {f.name} must be {expected}, got {value!r} ({type(value).__name__})")
        if base == "float" and not math.isfinite(value):
            raise ValueError(f"{where} key {f.name} must be a finite number, got {value!r}")
        if base in ("int", "float") and abs(value) > MAX_INT:
            raise ValueError(f"{where} key {f.name} must be between -{MAX_INT:,} and {MAX_INT:,}, got {value!r}")


def _check_finite(instance: Any) -> None:
    """NaN or Inf in a float field: refused before any range check (NaN passes every comparison's `not`)."""
    for f in fields(instance):
        value = getattr(instance, f.name)
        if _is_number(value) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def parse_overrides(overrides: list[str] | tuple[str, ...], cls: type = ModelConfig,
                    old_keys: dict[str, str] | None = None) -> dict[str, Any]:
    """Turn `["d_model=256", "norm_first=true"]` into typed values for the dataclass `cls`.

    `old_keys` maps old spellings to fields: such a key is parsed as its field and kept under the name given.
    Unknown keys and values that do not parse as the field's type raise ValueError.
    """
    types = {f.name: f.type for f in fields(cls)}
    known = {**types, **{old: types[new] for old, new in (old_keys or {}).items()}}
    result: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value")
        key, raw = (part.strip() for part in item.split("=", 1))
        if key not in known:
            raise ValueError(f"unknown config key {key!r}; known keys: {', '.join(sorted(types))}")
        result[key] = _parse_value(key, raw, str(known[key]))
    return result


def _parse_value(key: str, raw: str, type_name: str) -> Any:
    lowered = raw.lower()
    if "None" in type_name and lowered in ("none", "null", ""):
        return None
    if type_name.startswith("bool"):
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{key} expects true or false, got {raw!r}")
    if type_name.startswith("int"):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{key} expects an integer, got {raw!r}") from None
    if type_name.startswith("float"):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{key} expects a number, got {raw!r}") from None
    return raw


PRESETS: dict[str, ModelConfig] = {
    # The paper's Table 3, "base" and "big" rows, with the shared 37,000-token BPE vocabulary.
    "base": ModelConfig(),
    "big": ModelConfig(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3),
    # A real model for small corpora (tens of thousands of sentence pairs) on a CPU: about half an hour on two
    # cores for the English -> French gettext benchmark (examples/gettext-en-fr.toml).
    "small": ModelConfig(
        vocab_size=8000, d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3, max_len=512,
    ),
    # Small enough to train in minutes on two CPU cores.
    "tiny": ModelConfig(
        vocab_size=1000, d_model=64, n_heads=4, d_ff=256, n_encoder_layers=2, n_decoder_layers=2,
        max_len=256,
    ),
}


def preset(name: str) -> ModelConfig:
    """The named preset; ValueError lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
