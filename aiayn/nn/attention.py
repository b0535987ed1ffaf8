"""Multi-head attention (section 3.2): self-attention and cross-attention, with a key/value cache.

Two paths compute the same thing:
- by default `torch.nn.functional.scaled_dot_product_attention` (PyTorch's fused kernels);
- with `need_weights=True`, softmax(Q K^T / sqrt(d_k)) V written out, returning the weights.
The layers and models around it return their states only; `attention_weights` asks chosen attention
modules for their weights from outside, with forward hooks, and collects them.
Masks follow `aiayn.nn.masks`: bool, True = may attend.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.nn.masks import causal_mask


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
        """Keep batch rows `index` (beam search reorders hypotheses each step, and drops finished sentences).

        Rows are gathered into a second pair of buffers, which then swaps with the first: views of
        `key`/`value` taken before the previous reorder see the rows written by this one. Fewer rows than
        the cache holds go into new buffers of that many rows (with the same room to grow).
        """
        if self.key is None:
            return
        if not self._owns_views() or self.key.requires_grad:
            self.key, self.value = self.key.index_select(0, index), self.value.index_select(0, index)
            self._buffers = self._spare = None
            return
        length = self.key.shape[2]
        if index.numel() != self.key.shape[0]:  # fewer rows (finished sentences leave): buffers of the new size
            shape = (index.numel(), *self._buffers[0].shape[1:])
            spare = (self._buffers[0].new_empty(shape), self._buffers[1].new_empty(shape))
            self._buffers = None  # no spare of the old size is kept
        else:
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
    Q, K and V; head i owns rows [i*d_k, (i+1)*d_k). Attention runs on PyTorch's
    `scaled_dot_product_attention`, or, when the weights are asked for, as the equation written out.
    Faster ways to run the same module (one product for Q, K and V, oneDNN, bf16) are applied from
    outside by `aiayn.backends`.
    """

    # Under autocast, softmax(Q K^T / sqrt(d_k)) V itself in float32, its bf16 (or fp16) inputs cast up and its
    # output down, the projections still in the lower precision: set on a prepared copy by `aiayn.backends` where
    # the attention kernel's bf16 backward was measured the slower (`calibrate.bf16_training_attention`). Not where
    # `weights_dropout` writes the equation out: its products in bf16 were the faster (docs/notes.md, "Training").
    float32_attention = False
    # In training, a function (weights, p) -> dropped weights that drops attention weights instead of SDPA's own
    # dropout, the equation then written out: on a CPU, SDPA with dropout runs its written-out equation anyway (its
    # flash kernel takes no dropout) and draws the mask with `bernoulli_`. Set on a prepared copy by `aiayn.backends`
    # where masks drawn as random integers were measured faster (`dropout.use_bits_dropout`).
    weights_dropout: Callable[[torch.Tensor, float], torch.Tensor] | None = None

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

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention's projections of x (B, L, d_model): Q, K and V, each (B, L, d_model)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention's keys and values of memory (B, S, d_model), each (B, S, d_model)."""
        return self.k_proj(memory), self.v_proj(memory)

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
            need_weights: compute softmax(Q K^T / sqrt(d_k)) written out and return the weights.
            cache: keys/values kept across calls; self-attention appends the new positions,
                cross-attention (`static_kv=True`) computes them once and reuses them.
            static_kv: the keys/values do not change between calls (cross-attention).

        Returns:
            (output (B, L_q, d_model), weights (B, h, L_q, L_k) or None).
        """
        self._check_input("query", query)
        if key_value is not None:
            self._check_input("key_value", key_value, batch=query.shape[0])
        q, k, v, offset = self._heads(query, key_value, cache, static_kv)  # (B, h, L_q|L_k, d_k)
        written_out = self._drop(q, self.dropout if self.training else 0.0) is not None  # products in bf16 are fast
        if self.float32_attention and q.dtype in (torch.bfloat16, torch.float16) and not written_out:
            with torch.autocast(q.device.type, enabled=False):  # else autocast would cast them down again
                out, weights = self._equation(q.float(), k.float(), v.float(), mask, is_causal, offset, need_weights)
            out, weights = out.to(q.dtype), None if weights is None else weights.to(q.dtype)
        else:
            out, weights = self._equation(q, k, v, mask, is_causal, offset, need_weights)
        b, _, length, _ = out.shape
        out = out.transpose(1, 2).reshape(b, length, self.d_model)  # (B, L_q, d_model): heads concatenated
        return self.out_proj(out), weights

    def _equation(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                  offset: int, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`'s attention on split heads (B, h, L, d_k), the look-ahead mask included where asked."""
        q_len, k_len = q.shape[2], k.shape[2]
        dropout_p = self.dropout if self.training else 0.0
        if (is_causal and mask is None and offset == 0 and q_len == k_len and not need_weights
                and self._drop(q, dropout_p) is None):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True), None
        # One new query after its whole prefix (a cached decoding step) sees every key: no mask to build.
        if is_causal and not (q_len == 1 and offset + 1 >= k_len):
            causal = causal_mask(q_len, q.device, offset=offset)  # (1, 1, L_q, L_k)
            mask = causal if mask is None else mask & causal
        return self.attend(q, k, v, mask, dropout_p=dropout_p, need_weights=need_weights)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
               dropout_p: float, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Equation 1 on split heads by `attend` (see there): this layer's attention, also called by the decoding
        step (`aiayn.inference.steps`), which runs the layer's parts without its `forward`."""
        return attend(q, k, v, mask, dropout_p=dropout_p, need_weights=need_weights, drop=self._drop(q, dropout_p))

    def _drop(self, q: torch.Tensor, dropout_p: float) -> Callable[[torch.Tensor, float], torch.Tensor] | None:
        """`weights_dropout` where it applies: 0 < p < 1 (SDPA zeroes every weight at p 1), on a CPU."""
        return self.weights_dropout if 0.0 < dropout_p < 1.0 and q.device.type == "cpu" else None

    def _heads(self, query: torch.Tensor, key_value: torch.Tensor | None, cache: AttentionCache | None,
               static_kv: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Q (B, h, L_q, d_k), K and V (B, h, L_k, d_k) with the cached positions, and how many were cached."""
        reuse_kv = cache is not None and static_kv and cache.key is not None
        if key_value is None and not reuse_kv:
            q, k, v = (self._split_heads(t) for t in self.project_qkv(query))
        else:
            q = self._split_heads(self.q_proj(query))
            if reuse_kv:
                return q, cache.key, cache.value, 0  # computed on the first step
            k, v = (self._split_heads(t) for t in self.project_kv(key_value))
        if cache is None:
            return q, k, v, 0
        if static_kv:
            # Read at every later step: stored contiguous (B, h, S, d_k), so no step copies them again.
            cache.key, cache.value = k.contiguous(), v.contiguous()
            return q, cache.key, cache.value, 0
        offset = 0 if cache.key is None else cache.key.shape[2]
        k, v = cache.append(k, v)  # (B, h, offset + L_new, d_k)
        return q, k, v, offset

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.n_heads, self.d_k).transpose(1, 2)  # (B, h, L, d_k)

    def _check_input(self, name: str, x: torch.Tensor, batch: int | None = None) -> None:
        """Reject inputs that are not (B, L, d_model) with a message naming the shape."""
        if x.dim() != 3 or x.shape[-1] != self.d_model or (batch is not None and x.shape[0] != batch):
            expected = f"({'batch' if batch is None else batch}, length, {self.d_model})"
            raise ValueError(f"attention {name} must have shape {expected}, got {tuple(x.shape)}")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, dropout_p: float = 0.0,
           need_weights: bool = False, drop: Callable[[torch.Tensor, float], torch.Tensor] | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V per head (equation 1 of the paper).

    Args:
        q: (B, h, L_q, d_k); k, v: (B, h, L_k, d_k).
        mask: bool, broadcastable to (B, h, L_q, L_k), True = may attend; or the float bias `attention_bias` makes of
            such a mask once for many calls (a decoding step's source mask), added to the scores as it is.
        dropout_p: dropout on the weights.
        need_weights: write the equation out and return the weights; otherwise PyTorch's
            `scaled_dot_product_attention` computes the same without them.
        drop: a function (weights, p) -> dropped weights in place of `F.dropout`; with dropout_p above 0 the
            equation is written out, since SDPA cannot take it.

    Returns:
        (output (B, h, L_q, d_k), weights (B, h, L_q, L_k) or None).
    """
    # A query row with no key to attend to (a fully padded sequence) would give NaN in the
    # softmax; let it attend everywhere and zero its output instead, so values and gradients
    # stay finite.
    # Done on the device whether or not such a row exists: asking would read a value back to the host.
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attend's mask must be bool (True = may attend) or the float bias attention_bias makes of "
                        f"one, got {mask.dtype}")
    boolean = mask is not None and mask.dtype == torch.bool  # else a bias from `attention_bias`: no empty row
    empty_rows = None
    if boolean:
        empty_rows = ~mask.any(dim=-1, keepdim=True)  # (B|1, h|1, L_q|1, 1)
        mask = mask | empty_rows
    if need_weights or (drop is not None and dropout_p > 0):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, h, L_q, L_k)
        if boolean:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores += mask  # 0 leaves a score as it is, -inf masks it: the same scores as masked_fill
        if drop is not None and dropout_p > 0:
            # The weights and their dropout in float32, as SDPA's own dropout keeps them under bf16 autocast (the
            # scale 1 / (1 - p) rounded to bf16 would shrink every row: 1.109375 for 1 / 0.9); V's type for the product.
            weights = scores.softmax(dim=-1, dtype=torch.float32)  # (B, h, L_q, L_k), rows sum to 1
            out = drop(weights, dropout_p).to(v.dtype) @ v  # (B, h, L_q, d_k)
            weights = weights.to(scores.dtype) if need_weights else None
        else:
            weights = scores.softmax(dim=-1)  # (B, h, L_q, L_k), rows sum to 1
            out = (F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights) @ v  # (B, h, L_q, d_k)
            weights = weights if need_weights else None
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        weights = None
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
        if weights is not None:
            weights = weights.masked_fill(empty_rows, 0.0)
    return out, weights


def attention_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True = may attend) as the additive bias `attend` and SDPA take: 0 where a query may attend, -inf
    where not, in `dtype`. Made once where one mask serves many calls (a source mask at every decoding step), so that
    no call checks it again. A mask with a query that may attend to nothing is returned as it is: `attend` zeroes
    such a query's output, which a bias cannot say. Reads one value back to the host."""
    if mask is None or mask.dtype != torch.bool or not bool(mask.any(dim=-1).all()):
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


@contextmanager
def attention_weights(attentions: Sequence[nn.Module], *, keep: bool = True) -> Iterator[list[torch.Tensor | None]]:
    """While the block runs, each of `attentions` is called with `need_weights=True` (equation 1 written out).

    The layers pass their attention modules no flag and return their states only; this asks for the
    weights from outside, with forward hooks (removed when the block ends), the way `aiayn.inspect`
    records the other stages.

    Args:
        attentions: `MultiHeadAttention` modules (or a backend's versions of them), e.g.
            `[layer.cross_attn for layer in model.decoder.layers]`.
        keep: keep each module's latest weights in the list yielded; False only writes the equation out
            (the weights are freed as soon as the module returns, as without the hooks).

    Yields:
        One entry per module, in the order given: the weights (B, h, L_q, L_k) of its latest call, None
        before its first.
    """
    latest: list[torch.Tensor | None] = [None] * len(attentions)

    def ask(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "need_weights": True}

    def record(index: int, output: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        latest[index] = output[1]

    handles = [attn.register_forward_pre_hook(ask, with_kwargs=True) for attn in attentions]
    if keep:
        handles += [attn.register_forward_hook(lambda m, args, out, i=i: record(i, out))
                    for i, attn in enumerate(attentions)]
    try:
        yield latest
    finally:
        for handle in handles:
            handle.remove()
