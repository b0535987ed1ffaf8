"""Multi-head attention (section 3.2): self-attention and cross-attention, with a key/value cache.

Two paths compute the same thing:
- the fused path calls `torch.nn.functional.scaled_dot_product_attention` (fast, the default);
- the explicit path writes softmax(Q K^T / sqrt(d_k)) V out by hand and can return the weights.
Masks follow `aiayn.nn.masks`: bool, True = may attend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.nn.fast_linear import linear, matmul


@dataclass
class AttentionCache:
    """Keys and values of one attention sub-layer, each (B, h, S, d_k), kept across decoding steps.

    `append` writes new positions into buffers with room to spare (twice the length when they fill
    up), so a decoding step copies only its own key and value rather than the whole prefix;
    `key` and `value` are views of the buffers' filled part.
    """

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    _buffers: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _spare: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # reorder's target
    _views: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # the last key, value

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add (B, h, L_new, d_k) keys and values after the cached ones; returns all of them (B, h, L, d_k)."""
        if self.key is None or (torch.is_grad_enabled() and (key.requires_grad or self.key.requires_grad)):
            # The first step keeps its tensors; under autograd, writing into buffers that earlier
            # steps' views still hold would break backward, so the prefix is concatenated.
            if self.key is not None:
                key, value = torch.cat([self.key, key], dim=2), torch.cat([self.value, value], dim=2)
            self.key, self.value, self._buffers = key, value, None
            return key, value
        length, new = self.key.shape[2], key.shape[2]
        if not self._owns_views() or self._buffers[0].shape[2] < length + new:
            shape = (*self.key.shape[:2], 2 * (length + new), self.key.shape[3])  # (B, h, capacity, d_k)
            buffers = (self.key.new_empty(shape), self.value.new_empty(shape))
            buffers[0].narrow(2, 0, length).copy_(self.key)
            buffers[1].narrow(2, 0, length).copy_(self.value)
            self._buffers, self._spare = buffers, None
        key_buffer, value_buffer = self._buffers
        key_buffer.narrow(2, length, new).copy_(key)
        value_buffer.narrow(2, length, new).copy_(value)
        self.key, self.value = key_buffer.narrow(2, 0, length + new), value_buffer.narrow(2, 0, length + new)
        self._views = (self.key, self.value)
        return self.key, self.value

    def _owns_views(self) -> bool:
        """True while `key`/`value` are still this cache's views (not replaced from outside)."""
        return self._buffers is not None and self._views[0] is self.key and self._views[1] is self.value

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (beam search reorders hypotheses each step).

        Rows are gathered into a second pair of buffers, which then swaps with the first: views of
        `key`/`value` taken before the previous reorder see the rows written by this one.
        """
        if self.key is None:
            return
        if not self._owns_views() or index.numel() != self.key.shape[0] or self.key.requires_grad:
            self.key, self.value = self.key.index_select(0, index), self.value.index_select(0, index)
            self._buffers = self._spare = None
            return
        length = self.key.shape[2]
        spare = self._spare or (torch.empty_like(self._buffers[0]), torch.empty_like(self._buffers[1]))
        self.key = torch.index_select(self.key, 0, index, out=spare[0].narrow(2, 0, length))
        self.value = torch.index_select(self.value, 0, index, out=spare[1].narrow(2, 0, length))
        self._buffers, self._spare, self._views = spare, self._buffers, (self.key, self.value)


@dataclass
class KVCache:
    """The decoder's cache: per layer, self-attention keys/values that grow by one position per
    step, and cross-attention keys/values computed once from the encoder output."""

    self_attn: list[AttentionCache] = field(default_factory=list)
    cross_attn: list[AttentionCache] = field(default_factory=list)

    @classmethod
    def empty(cls, n_layers: int) -> KVCache:
        """A cache for `n_layers` decoder layers with nothing in it yet."""
        return cls([AttentionCache() for _ in range(n_layers)], [AttentionCache() for _ in range(n_layers)])

    @property
    def length(self) -> int:
        """Target positions already decoded (the offset of the next position)."""
        first = self.self_attn[0].key if self.self_attn else None
        return 0 if first is None else first.shape[2]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` in every layer's cache."""
        for cache in (*self.self_attn, *self.cross_attn):
            cache.reorder(index)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The h heads' projections are stored side by side in one (d_model, d_model) Linear each for
    Q, K and V; head i owns rows [i*d_k, (i+1)*d_k). On the fused path, self-attention computes
    Q, K and V with one matmul on the three weights concatenated (and cross-attention K and V with
    one), which is faster than three; the explicit path calls `q_proj`, `k_proj` and `v_proj` one by
    one, so forward hooks on them see every projection.
    """

    def __init__(self, d_model: int, n_heads: int, *, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        # Set True to make every call take the explicit path (tracing, attention maps, tests).
        self.explicit = False
        # Stacked Q/K/V (or K/V) weights for the fused path when autograd is off; see _fused_weights.
        self._fused_cache: dict[int, tuple] = {}
        # Optional module giving Q, K and V side by side (B, L, 3 * d_model) for self-attention on the
        # fused path (prepacked weights of `aiayn.inference.embeddings`); None: stacked as above.
        self.qkv_proj: nn.Module | None = None

    def train(self, mode: bool = True) -> MultiHeadAttention:
        """Set the mode and drop the stacked-weight cache.

        Some optimisers (PyTorch's fused CPU Adam) update weights in place without bumping their
        version counters; every train/eval switch therefore starts from fresh weights.
        """
        self._fused_cache.clear()
        return super().train(mode)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.n_heads, self.d_k).transpose(1, 2)  # (B, h, L, d_k)

    def _check_input(self, name: str, x: torch.Tensor, batch: int | None = None) -> None:
        """Reject inputs that are not (B, L, d_model) with a message naming the shape."""
        if x.dim() != 3 or x.shape[-1] != self.d_model or (batch is not None and x.shape[0] != batch):
            expected = f"({'batch' if batch is None else batch}, length, {self.d_model})"
            raise ValueError(f"attention {name} must have shape {expected}, got {tuple(x.shape)}")

    def _can_fuse(self, *projections: nn.Module) -> bool:
        """Plain Linears without hooks can share one matmul; anything else is called module by module."""
        return all(type(p) is nn.Linear and not (p._forward_hooks or p._forward_pre_hooks) for p in projections)

    def _fused_weights(self, projections: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projections' weights (n * d_model, d_model) and biases stacked; kept between calls without autograd.

        With autograd on they are concatenated afresh (gradients flow back through `torch.cat`); without it
        the stacked copy is reused until a weight changes (in place, replaced, moved or cast).
        """
        params = [t for p in projections for t in (p.weight, p.bias) if t is not None]
        key = None
        if not torch.is_grad_enabled():
            try:
                key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in params)
            except RuntimeError:  # inference tensors have no version counter: do not keep a copy
                key = None
            cached = self._fused_cache.get(len(projections))
            if key is not None and cached is not None and cached[0] == key:
                return cached[1], cached[2]
        weight = torch.cat([p.weight for p in projections])  # (n * d_model, d_model)
        bias = None if projections[0].bias is None else torch.cat([p.bias for p in projections])
        if key is not None:
            self._fused_cache[len(projections)] = (key, weight, bias)
        return weight, bias

    def _project(self, x: torch.Tensor, *projections: nn.Linear, fuse: bool) -> tuple[torch.Tensor, ...]:
        """x (B, L, d_model) through each projection, split into heads: one (B, h, L, d_k) per projection."""
        if fuse and len(projections) == 3 and self.qkv_proj is not None:  # self-attention's Q, K, V
            y = self.qkv_proj(x)  # (B, L, 3 * d_model)
        elif not fuse or len(projections) == 1 or not self._can_fuse(*projections):
            return tuple(self._split_heads(linear(p, x)) for p in projections)
        else:
            weight, bias = self._fused_weights(projections)
            y = matmul(x, weight, bias)  # (B, L, n * d_model)
        b, length, _ = y.shape
        y = y.view(b, length, len(projections), self.n_heads, self.d_k)  # (B, L, n, h, d_k)
        return y.permute(2, 0, 3, 1, 4).unbind(0)  # n x (B, h, L, d_k)

    def forward(
        self,
        query: torch.Tensor,
        key_value: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: AttentionCache | None = None,
        static_kv: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from `query` to `key_value` (to `query` itself when None).

        Args:
            query: (B, L_q, d_model).
            key_value: (B, L_k, d_model) for cross-attention; None for self-attention.
            mask: bool, broadcastable to (B, h, L_q, L_k), True = may attend.
            is_causal: add the look-ahead mask (query i sees keys <= i + cached length).
            need_weights: take the explicit path and return the (B, h, L_q, L_k) weights.
            cache: keys/values kept across calls; self-attention appends the new positions,
                cross-attention (`static_kv=True`) computes them once and reuses them.
            static_kv: the keys/values do not change between calls (cross-attention).

        Returns:
            (output (B, L_q, d_model), weights (B, h, L_q, L_k) or None).
        """
        self._check_input("query", query)
        if key_value is not None:
            self._check_input("key_value", key_value, batch=query.shape[0])
        explicit = need_weights or self.explicit
        reuse_kv = cache is not None and static_kv and cache.key is not None
        if key_value is None and not reuse_kv:
            # Self-attention: Q, K and V of the same input (one matmul on the fused path).
            q, k, v = self._project(query, self.q_proj, self.k_proj, self.v_proj, fuse=not explicit)
        else:
            (q,) = self._project(query, self.q_proj, fuse=False)  # (B, h, L_q, d_k)
            if reuse_kv:
                k, v = cache.key, cache.value  # (B, h, L_k, d_k), computed on the first step
            else:
                k, v = self._project(key_value, self.k_proj, self.v_proj, fuse=not explicit)  # (B, h, L_k, d_k)
        offset = 0
        if cache is not None and not reuse_kv:
            if static_kv:
                cache.key, cache.value = k, v
            else:
                offset = 0 if cache.key is None else cache.key.shape[2]
                k, v = cache.append(k, v)  # (B, h, offset + L_new, d_k)

        causal = None
        # One new query after its whole prefix (a cached decoding step) sees every key: no mask to build.
        if is_causal and not (q.shape[2] == 1 and offset + 1 >= k.shape[2]):
            causal = _causal(q.shape[2], k.shape[2], offset, q.device)  # (1, 1, L_q, L_k)
            mask = causal if mask is None else mask & causal

        # A query row with no key to attend to (a fully padded sequence) would give NaN in the
        # softmax; let it attend everywhere and zero its output instead, so values and gradients
        # stay finite.
        empty_rows = None
        if mask is not None:
            has_key = mask.any(dim=-1, keepdim=True)  # (B|1, h|1, L_q|1, 1)
            if not bool(has_key.all()):
                empty_rows = ~has_key
                mask = mask | empty_rows

        dropout_p = self.dropout if self.training else 0.0
        if explicit:
            out, weights = _explicit_attention(q, k, v, mask, dropout_p)
        else:
            weights = None
            if causal is not None and mask is causal and offset == 0 and q.shape[2] == k.shape[2]:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        if empty_rows is not None:
            out = out.masked_fill(empty_rows, 0.0)
            if weights is not None:
                weights = weights.masked_fill(empty_rows, 0.0)
        b, _, length, _ = out.shape
        out = out.transpose(1, 2).reshape(b, length, self.d_model)  # (B, L_q, d_model): heads concatenated
        return linear(self.out_proj, out), weights


def _causal(q_len: int, k_len: int, offset: int, device: torch.device) -> torch.Tensor:
    query_pos = torch.arange(offset, offset + q_len, device=device)[:, None]
    key_pos = torch.arange(k_len, device=device)[None, :]
    return (key_pos <= query_pos)[None, None]  # (1, 1, L_q, L_k)


def _explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(d_k)) V, written out (equation 1 of the paper)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, h, L_q, L_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)  # (B, h, L_q, L_k), rows sum to 1
    attended = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return attended @ v, weights  # (B, h, L_q, d_k)
