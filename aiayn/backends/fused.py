"""Fused Q/K/V: self-attention's three projections (and cross-attention's K and V) as one product.

W_Q, W_K and W_V are each (d_model, d_model) and read the same input, so stacking them into one
(3 d_model, d_model) matrix gives Q, K and V side by side from one matrix product, which is faster
than three. `FusedQKVAttention` is a `MultiHeadAttention` that keeps the same `q_proj`, `k_proj`,
`v_proj` and `out_proj` (the same parameters and state_dict) and overrides only `project_qkv` and
`project_kv`. For training the stack is concatenated on every call from the live weights (gradients
flow back through `torch.cat`); for inference it is built once, when the backend prepares the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aiayn.nn.attention import MultiHeadAttention, attend

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (x, weight, bias) -> y
Frozen = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]  # (stacked weight, bias) -> an inference layer
ROLES = {"self_attn": "self", "cross_attn": "cross"}  # the layers' attribute names in aiayn.nn.layers
SINGLE_QUERY_WRITTEN_OUT = 64  # rows x heads from which one-query attention runs written out (measured, CPU)


class FusedQKVAttention(MultiHeadAttention):
    """Multi-head attention whose input projections run as one stacked product.

    Built by `FusedQKVAttention.from_attention`; `product` computes x W^T + b (F.linear or its oneDNN
    equivalent); `qkv` and `kv` are the stacked layers fixed at prepare time (inference), or None
    to stack the live weights on every call (training).
    """

    product: Product
    qkv: nn.Module | None
    kv: nn.Module | None

    @classmethod
    def from_attention(cls, attn: MultiHeadAttention, *, product: Product, frozen: Frozen | None,
                       role: str = "any") -> FusedQKVAttention:
        """The fused twin of `attn`, sharing its projection modules (and so its parameters).

        Args:
            attn: a plain `MultiHeadAttention`.
            product: x (..., in), weight (out, in), bias -> (..., out).
            frozen: builds an inference layer from a stacked (weight, bias) once; None keeps
                stacking the live weights (training).
            role: "self" or "cross" attention builds only the stack that role uses; "any" both.
        """
        with torch.device("meta"):  # no weights allocated: the projections are attn's own
            fused = cls(attn.d_model, attn.n_heads, dropout=attn.dropout, bias=attn.q_proj.bias is not None)
        fused.q_proj, fused.k_proj, fused.v_proj, fused.out_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj
        fused.product = product
        fused.qkv = fused.kv = None
        if frozen is not None and role != "cross":
            fused.qkv = frozen(*_stacked((attn.q_proj, attn.k_proj, attn.v_proj)))  # (3 d_model, d_model)
        if frozen is not None and role != "self":
            fused.kv = frozen(*_stacked((attn.k_proj, attn.v_proj)))  # (2 d_model, d_model)
        fused.train(attn.training)
        return fused

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K and V of x (B, L, d_model), each a (B, L, d_model) view of one (B, L, 3 d_model) product.

        A stack not built at prepare time (training, or a role this layer was not expected to play)
        is concatenated from the live weights.
        """
        y = self.qkv(x) if self.qkv is not None else self.product(x, *_stacked((self.q_proj, self.k_proj, self.v_proj)))
        return y.split(self.d_model, dim=-1)

    def project_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of memory (B, S, d_model), each a view of one (B, S, 2 d_model) product."""
        y = self.kv(memory) if self.kv is not None else self.product(memory, *_stacked((self.k_proj, self.v_proj)))
        return y.split(self.d_model, dim=-1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
               dropout_p: float, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Equation 1; one query per row (a decoding step) over many rows and heads written out on CPU.

        SDPA's flash kernel pays its blocking for every (row, head), which at one query each costs more
        than the two products and softmax written out once rows x heads reach `SINGLE_QUERY_WRITTEN_OUT`;
        below that SDPA is the faster one (measured: docs/generation.md, "One-query attention").
        """
        if (q.shape[2] == 1 and q.device.type == "cpu" and not need_weights
                and q.shape[0] * q.shape[1] >= SINGLE_QUERY_WRITTEN_OUT):
            return attend(q, k, v, mask, dropout_p=dropout_p, need_weights=True)[0], None
        return super().attend(q, k, v, mask, dropout_p=dropout_p, need_weights=need_weights)


def _stacked(projections: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The projections' weights stacked (n * d_model, d_model) and their biases (n * d_model,) or None."""
    weight = torch.cat([p.weight for p in projections])
    bias = None if projections[0].bias is None else torch.cat([p.bias for p in projections])
    return weight, bias


class StackedLinear(nn.Module):
    """A linear layer over a weight fixed at prepare time (inference on devices without prepacking)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, product: Product):
        super().__init__()
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out)."""
        return self.product(x, self.weight, self.bias)


def fuse_qkv(model: nn.Module, *, product: Product, frozen: Frozen | None) -> nn.Module:
    """Replace every plain `MultiHeadAttention` in `model` (or `model` itself) by its fused twin, in place.

    Returns the model (a new object only when `model` itself is a `MultiHeadAttention`).
    """
    if type(model) is MultiHeadAttention:
        return FusedQKVAttention.from_attention(model, product=product, frozen=frozen)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is MultiHeadAttention and all(
                    type(p) is nn.Linear for p in (child.q_proj, child.k_proj, child.v_proj)):
                fused = FusedQKVAttention.from_attention(child, product=product, frozen=frozen,
                                                         role=ROLES.get(name, "any"))
                setattr(module, name, fused)
    return model
