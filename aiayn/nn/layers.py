"""The residual sub-layer (Add & Norm) and the encoder and decoder layers (section 3.1)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aiayn.nn.attention import AttentionCache, MultiHeadAttention
from aiayn.nn.feedforward import PositionwiseFeedForward


class SublayerConnection(nn.Module):
    """Add & Norm around one sub-layer.

    Post-LN (the paper, section 3.1): `LayerNorm(x + Dropout(Sublayer(x)))`.
    Pre-LN (`norm_first=True`): `x + Dropout(Sublayer(LayerNorm(x)))`.
    """

    def __init__(self, d_model: int, *, dropout: float, norm_first: bool, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Apply `sublayer` with the residual connection and layer normalisation."""
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))



class EncoderLayer(nn.Module):
    """Self-attention -> Add & Norm -> feed-forward -> Add & Norm."""

    def __init__(self, *, self_attn: MultiHeadAttention, feed_forward: PositionwiseFeedForward,
                 d_model: int, dropout: float, norm_first: bool, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.attn_sublayer = SublayerConnection(d_model, dropout=dropout, norm_first=norm_first, eps=eps)
        self.ffn_sublayer = SublayerConnection(d_model, dropout=dropout, norm_first=norm_first, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, is_causal: bool = False,
                cache: AttentionCache | None = None) -> torch.Tensor:
        """(B, S, d_model) -> (B, S, d_model); `mask` (B, 1, 1, S) marks real source tokens.

        `is_causal` adds the look-ahead mask and `cache` keeps the keys and values across calls: the layer of
        a decoder-only stack (the paper's decoder layer without cross-attention, as GPT uses it).
        The self-attention weights (B, h, S, S) come through `aiayn.nn.attention.attention_weights`.
        """

        def self_attention(y: torch.Tensor) -> torch.Tensor:
            return self.self_attn(y, mask=mask, is_causal=is_causal, cache=cache)[0]

        x = self.attn_sublayer(x, self_attention)
        return self.ffn_sublayer(x, self.feed_forward)


class DecoderLayer(nn.Module):
    """Masked self-attention -> Add & Norm -> cross-attention -> Add & Norm -> FFN -> Add & Norm."""

    def __init__(self, *, self_attn: MultiHeadAttention, cross_attn: MultiHeadAttention,
                 feed_forward: PositionwiseFeedForward, d_model: int, dropout: float,
                 norm_first: bool, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.cross_attn = cross_attn
        self.feed_forward = feed_forward
        self.self_attn_sublayer = SublayerConnection(d_model, dropout=dropout, norm_first=norm_first, eps=eps)
        self.cross_attn_sublayer = SublayerConnection(d_model, dropout=dropout, norm_first=norm_first, eps=eps)
        self.ffn_sublayer = SublayerConnection(d_model, dropout=dropout, norm_first=norm_first, eps=eps)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        *,
        tgt_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        self_cache: AttentionCache | None = None,
        cross_cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        """One decoder layer.

        Args:
            x: target states (B, T, d_model).
            memory: encoder output (B, S, d_model), fixed for the whole decoding.
            tgt_mask: bool mask of target keys (B, 1, 1|T, T_total); the look-ahead mask is always added.
            memory_mask: bool mask of source keys (B, 1, 1, S).
            self_cache, cross_cache: key/value caches for incremental decoding.

        Returns:
            (B, T, d_model). The self-attention (B, h, T, T_total) and cross-attention (B, h, T, S) weights
            come through `aiayn.nn.attention.attention_weights`.
        """

        def self_attention(y: torch.Tensor) -> torch.Tensor:
            return self.self_attn(y, mask=tgt_mask, is_causal=True, cache=self_cache)[0]

        def cross_attention(y: torch.Tensor) -> torch.Tensor:
            return self.cross_attn(y, memory, mask=memory_mask, cache=cross_cache, static_kv=True)[0]

        x = self.self_attn_sublayer(x, self_attention)
        x = self.cross_attn_sublayer(x, cross_attention)
        return self.ffn_sublayer(x, self.feed_forward)
