"""A decoder's parts as plain functions of their inputs, for the flat decoding step (`aiayn.inference.steps`).

A step of a narrow model over few rows costs more in calls than in arithmetic. Each module call, each product layer
choosing its kernel by the rows it is given, each attention choosing its form through two methods, runs Python
before any arithmetic: at d_model 128 and one row, the step spent about a quarter of its time there (docs/notes.md,
"Decoding"). The functions here are made once per search and row class (`aiayn.backends.shapes.row_class`) and
compute what the modules' `forward`s compute for inputs of that class; a module this file does not know runs its own
`forward`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends.cpu import PackedFeedForward, PackedLinear
from aiayn.backends.fused import WRITTEN_OUT_QUERIES, FusedQKVAttention, writes_out
from aiayn.backends.int8 import Int8Linear
from aiayn.backends.shapes import row_class
from aiayn.nn.attention import MultiHeadAttention, attend
from aiayn.nn.feedforward import PositionwiseFeedForward
from aiayn.nn.heads import VocabularyHead

Function = Callable[[torch.Tensor], torch.Tensor]


def product(layer: nn.Module, rows: int) -> Function:
    """x -> layer(x) for inputs of `rows` rows: the kernel a `PackedLinear` runs for them, the int8 product an
    `Int8Linear` runs for their row class (fbgemm's or oneDNN's) or the float32 layer it runs there, `F.linear` for
    a plain `nn.Linear`, else the layer's `forward`."""
    if isinstance(layer, PackedLinear):
        return layer.function(rows)
    if isinstance(layer, Int8Linear):
        chosen = layer.product(row_class(rows))
        return product(chosen, rows) if chosen is layer.float32 else chosen
    if type(layer) is nn.Linear:
        return functools.partial(F.linear, weight=layer.weight, bias=layer.bias)
    return layer.forward


def norm(module: nn.Module) -> Function:
    """x -> module(x): `torch.layer_norm` over a `nn.LayerNorm`'s own parameters, else the module's `forward`."""
    if type(module) is nn.LayerNorm:
        return functools.partial(torch.layer_norm, normalized_shape=module.normalized_shape, weight=module.weight,
                                 bias=module.bias, eps=module.eps)
    return module.forward


def feed_forward(ffn: nn.Module, rows: int) -> Function:
    """x -> ffn(x) for `rows` rows, where its dropout drops nothing (inference): the two products (the activation
    inside the first where the backend put it there), else the module's `forward`."""
    if not _drops_nothing(ffn.dropout) or type(ffn) not in (PackedFeedForward, PositionwiseFeedForward):
        return ffn.forward
    up, down = product(ffn.linear1, rows), product(ffn.linear2, rows)
    if type(ffn) is PackedFeedForward:
        return lambda x: down(up(x))
    activation = ffn.activation.forward
    return lambda x: down(activation(up(x)))


def head(module: nn.Module, rows: int) -> Function:
    """hidden -> logits for `rows` rows: a `VocabularyHead`'s product, else the module's `forward`."""
    return product(module.proj, rows) if type(module) is VocabularyHead else module.forward


def attention(attn: nn.Module) -> Callable[..., torch.Tensor]:
    """(q, k, v, mask) -> `attn.attend(q, k, v, mask)`'s output (B, h, L_q, d_k), no dropout, no weights: `attend`
    called directly (SDPA, or the equation written out where a `FusedQKVAttention` writes it out, `writes_out`), and
    written out too for a sentence's beams as the queries of its memory (up to `WRITTEN_OUT_QUERIES`, measured faster
    so in a step: docs/notes.md, "Decoding"); another attention through its own `attend`."""
    kind = type(attn)
    if kind not in (MultiHeadAttention, FusedQKVAttention):
        return lambda q, k, v, mask: attn.attend(q, k, v, mask, dropout_p=0.0, need_weights=False)[0]
    fused = kind is FusedQKVAttention

    def attended(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return attend(q, k, v, mask, need_weights=fused and writes_out(q, k, WRITTEN_OUT_QUERIES))[0]
    return attended


def project_qkv(attn: nn.Module, rows: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """y -> self-attention's Q, K and V of `rows` rows: a `FusedQKVAttention`'s stacked product, split three ways (as
    its `project_qkv`), else the layer's own `project_qkv`."""
    if not (isinstance(attn, FusedQKVAttention) and attn.qkv is not None):
        return attn.project_qkv
    stacked, width = product(attn.qkv, rows), attn.d_model
    return lambda y: stacked(y).split(width, dim=-1)


def _drops_nothing(dropout: nn.Module) -> bool:
    return isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and (not dropout.training
                                                                                      or dropout.p == 0))


__all__ = ["attention", "feed_forward", "head", "norm", "product", "project_qkv"]
