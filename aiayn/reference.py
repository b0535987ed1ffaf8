"""The Transformer's forward pass in NumPy (float64): an oracle for the PyTorch model, readable on its own.

Every function here is the paper's formula written out, in the style of seed 004's NumPy encoder:
`layer_norm`, `softmax`, `multi_head`, `ffn`, `encoder_layer`, `decoder_layer`, then `encode`,
`decode` and `forward` for the encoder-decoder and `encoder_hidden_states` for an encoder-only model.
They run on plain arrays exported from a model with `export_weights(model)`, keyed by the model's
`state_dict` names, and read the model's `ModelConfig` for the options (post-LN or pre-LN, ReLU or
GELU, sinusoidal interleaved/split or learned positions).

Masks follow the one convention of `aiayn.nn.masks`: bool, True = may attend. A query row with no
key to attend to gives a zero attention output, as the PyTorch model does.

Example:
    >>> weights = export_weights(model)
    >>> logits = forward(weights, model.config, src_ids, tgt_ids)   # (B, T, V) float64
"""

from __future__ import annotations

import math

import numpy as np

from aiayn.config import ModelConfig

Weights = dict[str, np.ndarray]


def export_weights(model) -> Weights:
    """A model's `state_dict` as float64 NumPy arrays, keyed by the same names."""
    return {name: t.detach().cpu().double().numpy() for name, t in model.state_dict().items()}


# -- the building blocks -----------------------------------------------------------------------


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis (biased variance, as torch)."""
    mu = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def softmax(s: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(s) / sum(exp(s)) along `axis`, shifted by the max for stability."""
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


_erf = np.vectorize(math.erf, otypes=[np.float64])


def activation(x: np.ndarray, name: str) -> np.ndarray:
    """ReLU max(0, x) (the paper), GELU x * Phi(x) (exact, with erf), or its tanh approximation."""
    if name == "relu":
        return np.maximum(0.0, x)
    if name == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise ValueError(f"unknown activation {name!r}")


def linear(x: np.ndarray, w: Weights, prefix: str) -> np.ndarray:
    """x W^T + b with torch's Linear layout: weight (out, in), optional bias (out,)."""
    y = x @ w[f"{prefix}.weight"].T
    bias = w.get(f"{prefix}.bias")
    return y if bias is None else y + bias


def sinusoidal(length: int, d_model: int, layout: str = "interleaved", offset: int = 0) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same); (length, d_model).

    `layout="split"` stores all sines first, then all cosines (tensor2tensor, Marian, fairseq).
    """
    pos = np.arange(offset, offset + length, dtype=np.float64)[:, None]  # (L, 1)
    angles = pos / 10000.0 ** (np.arange(0, d_model, 2, dtype=np.float64) / d_model)  # (L, d_model/2)
    if layout == "split":
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)
    pe = np.empty((length, d_model))
    pe[:, 0::2], pe[:, 1::2] = np.sin(angles), np.cos(angles)
    return pe


def padding_mask(ids: np.ndarray, pad_id: int) -> np.ndarray:
    """(B, L) ids -> (B, 1, 1, L) bool, True for real tokens (keys that may be attended to)."""
    return (ids != pad_id)[:, None, None, :]


def causal_mask(length: int) -> np.ndarray:
    """The look-ahead mask (1, 1, L, L): position i may attend to positions j <= i."""
    return np.tril(np.ones((length, length), dtype=bool))[None, None]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """softmax(Q K^T / sqrt(d_k)) V (equation 1); q (B, h, L_q, d_k), k and v (B, h, L_k, d_k).

    A query row whose mask is all False gives zeros (no key to attend to).
    """
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])  # (B, h, L_q, L_k)
    if mask is None:
        return softmax(scores) @ v
    mask = np.broadcast_to(mask, scores.shape)
    has_key = mask.any(axis=-1, keepdims=True)  # (B, h, L_q, 1)
    scores = np.where(mask | ~has_key, scores, -np.inf)  # rows without keys stay finite, zeroed below
    weights = np.where(has_key, softmax(scores), 0.0)  # (B, h, L_q, L_k)
    return weights @ v  # (B, h, L_q, d_k)


def multi_head(x: np.ndarray, memory: np.ndarray | None, w: Weights, prefix: str, n_heads: int,
               mask: np.ndarray | None = None) -> np.ndarray:
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O; self-attention when `memory` is None.

    Args:
        x: queries (B, L_q, d_model).
        memory: keys and values (B, L_k, d_model) for cross-attention, or None.
        w, prefix: weights of `<prefix>.q_proj`, `.k_proj`, `.v_proj`, `.out_proj`.
        n_heads: h; head i owns columns [i*d_k, (i+1)*d_k) of each projection.
        mask: bool, broadcastable to (B, h, L_q, L_k), True = may attend.

    Returns:
        (B, L_q, d_model).
    """
    source = x if memory is None else memory
    b, l_q, d_model = x.shape
    d_k = d_model // n_heads

    def split(t: np.ndarray) -> np.ndarray:  # (B, L, d_model) -> (B, h, L, d_k)
        return t.reshape(t.shape[0], t.shape[1], n_heads, d_k).transpose(0, 2, 1, 3)

    q = split(linear(x, w, f"{prefix}.q_proj"))
    k = split(linear(source, w, f"{prefix}.k_proj"))
    v = split(linear(source, w, f"{prefix}.v_proj"))
    heads = attention(q, k, v, mask)  # (B, h, L_q, d_k)
    concat = heads.transpose(0, 2, 1, 3).reshape(b, l_q, d_model)  # (B, L_q, d_model)
    return linear(concat, w, f"{prefix}.out_proj")


def ffn(x: np.ndarray, w: Weights, prefix: str, act: str = "relu") -> np.ndarray:
    """FFN(x) = act(x W1 + b1) W2 + b2, applied to every position alone (section 3.3)."""
    return linear(activation(linear(x, w, f"{prefix}.linear1"), act), w, f"{prefix}.linear2")


def add_and_norm(x: np.ndarray, sublayer, w: Weights, prefix: str, cfg: ModelConfig) -> np.ndarray:
    """Post-LN `LayerNorm(x + Sublayer(x))` (the paper) or pre-LN `x + Sublayer(LayerNorm(x))`."""
    gamma, beta = w[f"{prefix}.norm.weight"], w[f"{prefix}.norm.bias"]
    if cfg.norm_first:
        return x + sublayer(layer_norm(x, gamma, beta, cfg.layer_norm_eps))
    return layer_norm(x + sublayer(x), gamma, beta, cfg.layer_norm_eps)


def encoder_layer(x: np.ndarray, w: Weights, prefix: str, cfg: ModelConfig,
                  mask: np.ndarray | None = None) -> np.ndarray:
    """Self-attention -> Add & Norm -> FFN -> Add & Norm; (B, S, d_model) -> (B, S, d_model)."""
    x = add_and_norm(x, lambda y: multi_head(y, None, w, f"{prefix}.self_attn", cfg.n_heads, mask),
                     w, f"{prefix}.attn_sublayer", cfg)
    return add_and_norm(x, lambda y: ffn(y, w, f"{prefix}.feed_forward", cfg.activation),
                        w, f"{prefix}.ffn_sublayer", cfg)


def decoder_layer(x: np.ndarray, memory: np.ndarray, w: Weights, prefix: str, cfg: ModelConfig,
                  memory_mask: np.ndarray | None = None, tgt_mask: np.ndarray | None = None) -> np.ndarray:
    """Masked self-attention -> Add & Norm -> cross-attention -> Add & Norm -> FFN -> Add & Norm.

    The look-ahead mask is always applied; `tgt_mask` (B, 1, 1|T, T) may hide target keys too.
    """
    self_mask = causal_mask(x.shape[1])
    if tgt_mask is not None:
        self_mask = self_mask & tgt_mask
    x = add_and_norm(x, lambda y: multi_head(y, None, w, f"{prefix}.self_attn", cfg.n_heads, self_mask),
                     w, f"{prefix}.self_attn_sublayer", cfg)
    x = add_and_norm(x, lambda y: multi_head(y, memory, w, f"{prefix}.cross_attn", cfg.n_heads, memory_mask),
                     w, f"{prefix}.cross_attn_sublayer", cfg)
    return add_and_norm(x, lambda y: ffn(y, w, f"{prefix}.feed_forward", cfg.activation),
                        w, f"{prefix}.ffn_sublayer", cfg)


def embed(ids: np.ndarray, w: Weights, prefix: str, cfg: ModelConfig,
          token_type_ids: np.ndarray | None = None) -> np.ndarray:
    """Token embedding x sqrt(d_model) (section 3.4) + positions (section 3.5); (B, L) -> (B, L, d_model)."""
    x = w[f"{prefix}.tokens.weight"][ids]  # (B, L, d_model)
    if cfg.scale_embeddings:
        x = x * math.sqrt(cfg.d_model)
    length = ids.shape[1]
    if cfg.positional == "sinusoidal":
        x = x + sinusoidal(length, cfg.d_model, cfg.pe_layout)
    elif cfg.positional == "learned":
        if length > cfg.max_len:
            raise ValueError(f"sequence of {length} tokens is longer than the {cfg.max_len} learned positions")
        x = x + w[f"{prefix}.positions.weight"][:length]
    if f"{prefix}.token_types.weight" in w:
        types = np.zeros_like(ids) if token_type_ids is None else token_type_ids
        x = x + w[f"{prefix}.token_types.weight"][types]
    if f"{prefix}.norm.weight" in w:
        x = layer_norm(x, w[f"{prefix}.norm.weight"], w[f"{prefix}.norm.bias"], cfg.layer_norm_eps)
    return x


def _stack(x: np.ndarray, w: Weights, prefix: str, n_layers: int, cfg: ModelConfig, layer) -> np.ndarray:
    for i in range(n_layers):
        x = layer(x, f"{prefix}.layers.{i}")
    if cfg.norm_first:  # pre-LN stacks end with a LayerNorm
        x = layer_norm(x, w[f"{prefix}.final_norm.weight"], w[f"{prefix}.final_norm.bias"], cfg.layer_norm_eps)
    return x


# -- whole models ------------------------------------------------------------------------------


def encode(w: Weights, cfg: ModelConfig, src: np.ndarray, src_mask: np.ndarray | None = None) -> np.ndarray:
    """Encoder-decoder model: source ids (B, S) -> memory (B, S, d_model). Mask defaults to pad ids."""
    if src_mask is None:
        src_mask = padding_mask(src, cfg.pad_id)
    x = embed(src, w, "src_embed", cfg)
    return _stack(x, w, "encoder", cfg.n_encoder_layers, cfg,
                  lambda y, p: encoder_layer(y, w, p, cfg, src_mask))


def decode(w: Weights, cfg: ModelConfig, tgt: np.ndarray, memory: np.ndarray,
           memory_mask: np.ndarray | None = None) -> np.ndarray:
    """Shifted target ids (B, T) attending to memory (B, S, d_model) -> decoder states (B, T, d_model)."""
    x = embed(tgt, w, "tgt_embed", cfg)
    return _stack(x, w, "decoder", cfg.n_decoder_layers, cfg,
                  lambda y, p: decoder_layer(y, memory, w, p, cfg, memory_mask))


def forward(w: Weights, cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """Teacher forcing: source ids (B, S), shifted target ids (B, T) -> logits (B, T, V)."""
    src_mask = padding_mask(src, cfg.pad_id)
    memory = encode(w, cfg, src, src_mask)
    return linear(decode(w, cfg, tgt, memory, src_mask), w, "head.proj")


def encoder_hidden_states(w: Weights, cfg: ModelConfig, ids: np.ndarray, attention_mask: np.ndarray | None = None,
                          token_type_ids: np.ndarray | None = None) -> np.ndarray:
    """Encoder-only model: ids (B, L) -> hidden states (B, L, d_model).

    `attention_mask` (B, L) is 1/True for real tokens; by default tokens equal to `pad_id` are masked.
    """
    mask = padding_mask(ids, cfg.pad_id) if attention_mask is None else attention_mask.astype(bool)[:, None, None, :]
    x = embed(ids, w, "embed", cfg, token_type_ids)
    return _stack(x, w, "encoder", cfg.n_encoder_layers, cfg, lambda y, p: encoder_layer(y, w, p, cfg, mask))
