"""Sizes by arithmetic: what a config's model holds and needs, from its numbers alone (microseconds, any config).

`build_model` and the loaders ask here before they allocate anything, so a config that asks for a million layers,
a position table of 10^9 rows or a vocabulary of 10^12 types is refused at once, naming the sizes, instead of
after minutes of building on the meta device. `parameter_count` matches `sum(p.numel())` of the built model
exactly (tests/hardening/test_sizes.py holds it for the presets); the byte figures are estimates that round up.
"""

from __future__ import annotations

from aiayn.config import ModelConfig
from aiayn.nn.embedding import TABLE_BLOCK_VALUES
from aiayn.tasks.names import MASKED_LM, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION

FLOAT_BYTES = 4  # parameters, buffers and activations are fp32 when built
# Python's own memory for a layer's modules (about 15 nn.Modules, their dicts and tensor objects), whatever the
# widths, rounded up from what a layer of each kind takes (tests/hardening/test_sizes.py measures it).
ENCODER_LAYER_OVERHEAD = 64 * 1024
DECODER_LAYER_OVERHEAD = 96 * 1024
# Building a sinusoidal table works on one block of rows at a time beside the finished fp32 table
# (`sinusoidal_table`): float64 angles, sines, cosines and their interleaved stack, 2.5 float64 a value of the block,
# and the allocator's copies of them; 16 float64 a value bounds what was measured (tests/hardening/test_sizes.py).
TABLE_BUILD_BYTES = 16 * 8 * TABLE_BLOCK_VALUES


def _linear(d_in: int, d_out: int, bias: bool) -> int:
    return d_in * d_out + (d_out if bias else 0)


def _norm(d_model: int) -> int:
    return 2 * d_model  # LayerNorm's weight and bias


def _attention(cfg: ModelConfig) -> int:
    return 4 * _linear(cfg.d_model, cfg.d_model, cfg.bias)  # W_Q, W_K, W_V, W_O (section 3.2.2)


def _feed_forward(cfg: ModelConfig) -> int:
    return _linear(cfg.d_model, cfg.d_ff, cfg.bias) + _linear(cfg.d_ff, cfg.d_model, cfg.bias)


def encoder_layer_parameters(cfg: ModelConfig) -> int:
    """Parameters of one encoder layer: self-attention, feed-forward, two LayerNorms."""
    return _attention(cfg) + _feed_forward(cfg) + 2 * _norm(cfg.d_model)


def decoder_layer_parameters(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer: self- and cross-attention, feed-forward, three LayerNorms."""
    return 2 * _attention(cfg) + _feed_forward(cfg) + 3 * _norm(cfg.d_model)


def _embeddings(cfg: ModelConfig, vocab_size: int | None) -> int:
    """One `Embeddings` (token table unless shared: `vocab_size` None; learned positions; token types; norm)."""
    d = cfg.d_model
    tokens = vocab_size * d if vocab_size is not None else 0
    positions = cfg.max_len * d if cfg.positional == "learned" else 0
    norm = _norm(d) if cfg.embedding_norm else 0
    return tokens + positions + cfg.type_vocab_size * d + norm


def _head(cfg: ModelConfig) -> int:
    d = cfg.d_model
    if cfg.head in (SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION):
        return _linear(d, cfg.num_labels, True)
    if cfg.head == MASKED_LM:
        proj = cfg.vocab_size if cfg.tie_embeddings else _linear(d, cfg.vocab_size, True)  # a tied one keeps its bias
        return _linear(d, d, True) + _norm(d) + proj
    if cfg.causal:  # the vocabulary projection, without a bias
        return 0 if cfg.tie_embeddings else d * cfg.vocab_size
    return 0


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of `build_model(cfg)`, each shared tensor counted once (as `sum(p.numel())` counts them)."""
    final_norm = _norm(cfg.d_model) if cfg.norm_first else 0
    encoder = cfg.n_encoder_layers * encoder_layer_parameters(cfg) + final_norm
    if not cfg.has_cross_attention:
        return _embeddings(cfg, cfg.vocab_size) + encoder + _head(cfg)
    decoder = cfg.n_decoder_layers * decoder_layer_parameters(cfg) + final_norm
    target = None if cfg.share_embeddings else cfg.target_vocab_size
    head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.target_vocab_size
    return _embeddings(cfg, cfg.vocab_size) + _embeddings(cfg, target) + encoder + decoder + head


def position_tables(cfg: ModelConfig) -> int:
    """Sinusoidal tables the model keeps as buffers (one per embedding: two for an encoder-decoder)."""
    return 0 if cfg.positional != "sinusoidal" else (2 if cfg.has_cross_attention else 1)


def model_bytes(cfg: ModelConfig) -> int:
    """Peak bytes of building the model: parameters, sinusoidal tables (and a block's work), Python's modules."""
    tables = position_tables(cfg)
    building = tables * cfg.max_len * cfg.d_model * FLOAT_BYTES + (TABLE_BUILD_BYTES if tables else 0)
    modules = cfg.n_encoder_layers * ENCODER_LAYER_OVERHEAD + cfg.n_decoder_layers * DECODER_LAYER_OVERHEAD
    return parameter_count(cfg) * FLOAT_BYTES + building + modules


def forward_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
    """Peak bytes of one encoder forward pass over (batch, length) ids, without autograd: the residual stream and
    a layer's intermediate values (B, L, d_ff), plus one layer's attention scores and softmax (B, h, L, L)."""
    stream = batch * length * (4 * cfg.d_model + cfg.d_ff) * FLOAT_BYTES
    scores = 2 * batch * cfg.n_heads * length * length * FLOAT_BYTES
    return stream + scores


def training_bytes(cfg: ModelConfig, max_tokens: int, longest: int) -> int:
    """Peak bytes of a training step on batches of `max_tokens` tokens in rows of `longest`: the model, its
    parameters' gradients and Adam's two moments, every layer's activations kept for the backward pass (a decoder
    layer counts twice: self- and cross-attention), and the vocabulary logits with their softmax and gradient."""
    length = max(1, min(longest, max_tokens))
    batch = max(1, max_tokens // length)
    layers = cfg.n_encoder_layers + 2 * cfg.n_decoder_layers
    per_label = cfg.head in (SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION)
    logits = 3 * batch * length * (cfg.num_labels if per_label else cfg.target_vocab_size)
    return (model_bytes(cfg) + 3 * parameter_count(cfg) * FLOAT_BYTES + layers * forward_bytes(cfg, batch, length)
            + logits * FLOAT_BYTES)


def describe(cfg: ModelConfig) -> str:
    """The sizes that make a model large, as a user would change them."""
    layers = f"{cfg.n_encoder_layers:,}" + (f"+{cfg.n_decoder_layers:,}" if cfg.has_cross_attention else "")
    parts = [f"{parameter_count(cfg):,} parameters", f"layers {layers}", f"d_model {cfg.d_model:,}",
             f"d_ff {cfg.d_ff:,}", f"vocab_size {cfg.vocab_size:,}", f"max_len {cfg.max_len:,}"]
    if cfg.tgt_vocab_size is not None:
        parts.append(f"tgt_vocab_size {cfg.tgt_vocab_size:,}")
    if cfg.type_vocab_size:
        parts.append(f"type_vocab_size {cfg.type_vocab_size:,}")
    return ", ".join(parts)


def largest_part(cfg: ModelConfig) -> str:
    """The config key whose part takes the most memory (what to make smaller first)."""
    d, table = cfg.d_model, cfg.max_len * cfg.d_model
    parts = {
        "the layers (n_encoder_layers, n_decoder_layers, d_model, d_ff)":
            cfg.n_encoder_layers * (encoder_layer_parameters(cfg) * FLOAT_BYTES + ENCODER_LAYER_OVERHEAD)
            + cfg.n_decoder_layers * (decoder_layer_parameters(cfg) * FLOAT_BYTES + DECODER_LAYER_OVERHEAD),
        "vocab_size": cfg.vocab_size * d * FLOAT_BYTES,
        "tgt_vocab_size": (cfg.target_vocab_size * d * FLOAT_BYTES * 2
                           if cfg.has_cross_attention and not cfg.share_embeddings else 0),
        "max_len": table * FLOAT_BYTES * (position_tables(cfg) + (cfg.positional == "learned")),
        "type_vocab_size": cfg.type_vocab_size * d * FLOAT_BYTES * (2 if cfg.has_cross_attention else 1),
    }
    return max(parts, key=parts.__getitem__)


def available_memory() -> int | None:
    """Bytes of memory this machine has available now (Linux's MemAvailable); None where it cannot tell."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(nbytes: int, what: str, fix: str, *, sizes: str = "") -> None:
    """Raise MemoryError (the CLI's exit code 4) before allocating when `what` needs more than is available;
    `sizes` (what makes it large) follows the figures."""
    available = available_memory()
    if available is not None and nbytes > available:
        shown = f" ({sizes})" if sizes else ""
        raise MemoryError(f"{what} needs about {_gib(nbytes)} of memory, more than the "
                          f"{_gib(available)} available{shown}: {fix}")


def check_model_fits(cfg: ModelConfig, *, extra: int = 0, what: str = "a model of this config") -> None:
    """Refuse a config whose model (plus `extra` bytes, e.g. the weights file read beside it) would not fit."""
    check_memory(model_bytes(cfg) + extra, what, f"make {largest_part(cfg)} smaller", sizes=describe(cfg))


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


__all__ = ["available_memory", "check_memory", "check_model_fits", "decoder_layer_parameters", "describe",
           "encoder_layer_parameters", "forward_bytes", "model_bytes", "parameter_count", "training_bytes"]
