"""Cross-attention at decoding steps with W_Q absorbed into the memory's keys and W_O into its values.

A decoding step's cross-attention reads two (d_model, d_model) weights, W_Q and W_O, to attend one
query per row (the beams of a sentence together) over S memory positions that stay the same for the whole
search. Per head h (d_k wide, scale 1 / sqrt(d_k)), with q_h = x W_Q,h^T + b_Q,h (W_Q,h: head h's rows of W_Q):

    scores_h = scale q_h K_h^T  = x (scale W_Q,h^T K_h^T) + scale b_Q,h K_h^T   -> x A + c
    output   = sum_h p_h V_h W_O,h^T + b_O  = p (V_h W_O,h^T stacked over h) + b_O -> p C + b_O

where p_h = softmax(scores_h) and W_O,h is head h's columns of W_O. A (d_model, h S), c (h S,) and
C (h S, d_model) are made once per memory, from its cached keys and values; each step then runs two
small batched products and a softmax instead of two weight-sized products and the attention between.
The same sums in another order: results equal the plain step's up to float32 rounding.

A and C hold B h S d_model floats each against W_Q's and W_O's d_model^2, so they are used only where
B h S <= d_model * `MAX_FRACTION`, B counting sentences, not their beams (a base model at batch 1: sources of up
to 32 tokens); beyond that the weights are the smaller read. Measured on both CPU kinds: docs/notes.md,
"Decoding" (cross-attention absorbed into the memory).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from aiayn.nn.attention import MultiHeadAttention
from aiayn.nn.layers import DecoderLayer

MAX_FRACTION = 0.5  # absorbed keys and values are used where they hold at most this share of W_Q's and W_O's floats


class AbsorbedCrossAttention(nn.Module):
    """A decoder layer's cross-attention that decoding steps may run over the absorbed memory.

    `forward` is the wrapped module's own (the modules' path, and every call asking for the weights). The
    decoding step (`aiayn.inference.steps`) asks `absorb` for A, c and C once per memory, where
    `absorbing_reads_less`, and runs `attend_absorbed` at each step. The weights are read from the wrapped
    module's projections as they are when built (sharing their storage): build it before a backend swaps
    those projections.
    """

    def __init__(self, attn: MultiHeadAttention):
        super().__init__()
        self.attn = attn
        # Plain tensors sharing the parameters' storage (not registered again as this module's parameters).
        self.w_q, self.w_o = attn.q_proj.weight.detach(), attn.out_proj.weight.detach()  # (d_model, d_model)
        self.b_q = None if attn.q_proj.bias is None else attn.q_proj.bias.detach()
        self.b_o = None if attn.out_proj.bias is None else attn.out_proj.bias.detach()

    def __getattr__(self, name: str):
        """The wrapped module's parts (`d_model`, `n_heads`, `q_proj`, ...), for code that reads them."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("attn"), name)

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`MultiHeadAttention.forward` of the wrapped module."""
        return self.attn(*args, **kwargs)

    def absorb(self, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> tuple | None:
        """A, c, C (see `absorb`) of the memory's keys and values (B, h, S, d_k), or None where absorbing does not
        apply: float32 on CPU, absorbed tensors within `MAX_FRACTION` of the weights."""
        if not (key.device.type == "cpu" and key.dtype == torch.float32 and absorbing_reads_less(*key.shape[:3],
                                                                                               self.attn.d_model)):
            return None
        return absorb(key, value, mask, self.w_q, self.b_q, self.w_o)

    def attend_absorbed(self, query: torch.Tensor, absorbed: tuple) -> torch.Tensor:
        """Cross-attention of L queries per memory (B, L, d_model) over the absorbed memory -> (B, L, d_model): one new
        position of each sentence, or of each of its beams."""
        a, c, values_out = absorbed
        batch, queries, heads = query.shape[0], query.shape[1], self.attn.n_heads
        scores = torch.baddbmm(c, query, a)  # (B, L, h S): every head's scores side by side
        weights = scores.view(batch, queries, heads, -1).softmax(dim=-1).view(batch, queries, -1)  # (B, L, h S)
        out = torch.bmm(weights, values_out)  # (B, L, d_model): the heads' outputs through W_O, summed
        return out if self.b_o is None else out.add_(self.b_o)


def absorbing_reads_less(batch: int, heads: int, length: int, d_model: int) -> bool:
    """Whether the absorbed keys and values of (batch, heads, length) memory positions hold at most `MAX_FRACTION` of
    W_Q's and W_O's floats, so that a step reads less with them than with the weights."""
    return batch * heads * length <= d_model * MAX_FRACTION


def absorb(key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, w_q: torch.Tensor,
         b_q: torch.Tensor | None, w_o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The memory's keys and values (B, h, S, d_k) with W_Q and W_O absorbed (see the module).

    Args:
        mask: bool (B, 1, 1, S), True = may attend, or None. A masked position's score offset c is -inf;
            a row that may attend nowhere attends everywhere with zero values, as `attend` makes it.

    Returns:
        A (B, d_model, h S), c (B, 1, h S), C (B, h S, d_model).
    """
    batch, heads, length, d_k = key.shape
    d_model = w_q.shape[1]
    scale = 1 / math.sqrt(d_k)
    a = torch.einsum("hkd,bhsk->bdhs", w_q.view(heads, d_k, d_model), key).reshape(batch, d_model, -1) * scale
    if b_q is None:
        c = key.new_zeros(batch, heads, length)
    else:
        c = torch.einsum("hk,bhsk->bhs", b_q.view(heads, d_k), key) * scale  # (B, h, S)
    values_out = torch.einsum("bhsk,dhk->bhsd", value, w_o.view(d_model, heads, d_k))  # (B, h, S, d_model)
    if mask is not None:
        allowed = mask.expand(batch, 1, 1, length).reshape(batch, 1, length)  # (B, 1, S)
        empty = ~allowed.any(dim=-1)  # (B, 1)
        c = c.masked_fill(~(allowed | empty[..., None]), float("-inf"))
        values_out = values_out.masked_fill(empty[:, :, None, None], 0.0)
    return a.contiguous(), c.reshape(batch, 1, -1), values_out.reshape(batch, heads * length, d_model)


def absorb_cross_attention(model: nn.Module) -> None:
    """Wrap every decoder layer's cross-attention in an `AbsorbedCrossAttention`, in place (inference copies)."""
    for module in model.modules():
        if isinstance(module, DecoderLayer) and isinstance(module.cross_attn, MultiHeadAttention):
            module.cross_attn = AbsorbedCrossAttention(module.cross_attn)
