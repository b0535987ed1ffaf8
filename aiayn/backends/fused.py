"""Fused Q/K/V: self-attention's three projections (and cross-attention's K and V) as one product.

W_Q, W_K and W_V are each (d_model, d_model) and read the same input, so stacking them into one
(3 d_model, d_model) matrix gives Q, K and V side by side from one matrix product, which is faster
than three. `FusedQKVAttention` is a `MultiHeadAttention` that keeps the same `q_proj`, `k_proj`,
`v_proj` and `out_proj` (the same parameters and state_dict) and overrides `project_qkv` and
`project_kv` (and `attend`, for one query per row on CPU). For training the stack is concatenated on
every call from the live weights (gradients flow back through `torch.cat`); for inference it is built
once, when the backend prepares the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aiayn.backends.hooks import hooked
from aiayn.backends.shapes import FEW_ROWS_MAX
from aiayn.nn.attention import AttentionCache, MultiHeadAttention, attend
from aiayn.nn.feedforward import PositionwiseFeedForward
from aiayn.nn.layers import EncoderLayer

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (x, weight, bias) -> y
Frozen = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]  # (stacked weight, bias) -> an inference layer
ROLES = {"self_attn": "self", "cross_attn": "cross"}  # the layers' attribute names in aiayn.nn.layers
# One-query attention (a decoding step's self-attention; its cross-attention takes a sentence's beams as the queries
# of its memory, at most `WRITTEN_OUT_QUERIES`) runs written out from this many rows x heads, over keys of at least
# this many floats a head
# (keys x d_k); below either, SDPA's flash kernel is the faster (measured, CPU: docs/notes.md, "Decoding"). Below
# 400 multiply-adds a matrix PyTorch's batched product runs its own unvectorised loop instead of MKL's (its
# `bmm_out_or_baddbmm_`): one query over keys of fewer floats than that is 2-2.5x slower written out.
SINGLE_QUERY_WRITTEN_OUT = 128
SINGLE_QUERY_WRITTEN_OUT_KEYS = 400
WRITTEN_OUT_QUERIES = 16  # measured from 1 to 32 queries: written out 1.14-1.39x faster at 2-32 over 20-40 keys
# PyTorch's fused encoder layer writes out the attention scores of every row and head (B x h x L x L floats);
# for sequences longer than this, or scores of more bytes (32 base-model sentences of 181 tokens), the layer
# written out, whose attention is blocked (never an L x L matrix), runs instead.
FUSED_MAX_LENGTH = 256
FUSED_SCORES_BYTES = 32 << 20


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
        than the two products and softmax written out once rows x heads reach `SINGLE_QUERY_WRITTEN_OUT`; over
        few keys (keys x d_k under `SINGLE_QUERY_WRITTEN_OUT_KEYS`) the products written out are the slower, and SDPA
        runs (measured: docs/notes.md, "Decoding", one-query attention).
        """
        if not need_weights and writes_out(q, k):
            return attend(q, k, v, mask, dropout_p=dropout_p, need_weights=True, drop=self._drop(q, dropout_p))[0], None
        return super().attend(q, k, v, mask, dropout_p=dropout_p, need_weights=need_weights)


def writes_out(q: torch.Tensor, k: torch.Tensor, queries: int = 1) -> bool:
    """Whether attention of q (B, h, L_q, d_k) over k (B, h, L_k, d_k) runs written out rather than on SDPA's flash
    kernel (`SINGLE_QUERY_WRITTEN_OUT`, `SINGLE_QUERY_WRITTEN_OUT_KEYS`), for at most `queries` queries per row and
    head: one in `FusedQKVAttention.attend`; up to `WRITTEN_OUT_QUERIES` in a decoding step, whose cross-attention
    takes a sentence's beams as the queries of its memory (`aiayn.inference.parts.attention`)."""
    return (q.shape[2] <= queries and q.device.type == "cpu" and q.shape[0] * q.shape[1] >= SINGLE_QUERY_WRITTEN_OUT
            and k.shape[2] * k.shape[3] >= SINGLE_QUERY_WRITTEN_OUT_KEYS)


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
    """Replace every `MultiHeadAttention` in `model` (or `model` itself) by its fused twin, in place.

    Only a `MultiHeadAttention` itself: the twin runs that class's `forward`, which a subclass (this module's own
    included) may not. Its projections may be any `nn.Linear`: the stack reads their weights and biases.
    Returns the model (a new object only when `model` itself is a `MultiHeadAttention`).
    """
    if type(model) is MultiHeadAttention:
        return FusedQKVAttention.from_attention(model, product=product, frozen=frozen)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is MultiHeadAttention and all(
                    isinstance(p, nn.Linear) for p in (child.q_proj, child.k_proj, child.v_proj)):
                fused = FusedQKVAttention.from_attention(child, product=product, frozen=frozen,
                                                         role=ROLES.get(name, "any"))
                setattr(module, name, fused)
    return model


def stacked_away(model: nn.Module) -> frozenset[int]:
    """Projections an inference copy never calls on their own: their weights are in a frozen Q/K/V stack."""
    unused = set()
    for m in model.modules():
        if isinstance(m, FusedQKVAttention) and (m.qkv is not None or m.kv is not None):
            unused.update((id(m.k_proj), id(m.v_proj)))
            if m.kv is None:  # self-attention only: the query comes from the stack too
                unused.add(id(m.q_proj))
    return frozenset(unused)


class TorchEncoderLayer(nn.Module):
    """An encoder layer run by PyTorch's own fused layer (`torch._transformer_encoder_layer_fwd`, the kernel of
    `nn.TransformerEncoderLayer`'s inference fast path and of Hugging Face's BetterTransformer), with the plain
    layer's weights.

    The fused layer runs the same arithmetic in one C++ call: Q, K and V from one product without bias, their
    bias and the 1 / sqrt(d_k) scale in one pass, in-place residual adds, PyTorch's default products. `select`
    uses it where calibration measured it faster than the layer written out on the kernels chosen there
    (`calibrate`, a base layer on 2 x 128 tokens; figures in docs/notes.md). It runs only where it computes what
    `layer` does: inference (eval mode, no gradients) on float32 CPU inputs (B, S, d_model) of more than
    `shapes.FEW_ROWS_MAX` rows, no padded-out sequence, no hook on the layer's modules (recorded attention,
    profilers), and sequences and scores within `FUSED_MAX_LENGTH` and `FUSED_SCORES_BYTES` (it writes the
    L x L attention matrices out); any other call runs `layer` itself. The weights are copied out when built:
    prepare again after changing them.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        attn, ffn = layer.self_attn, layer.feed_forward
        d_model = attn.d_model
        norms = (layer.attn_sublayer.norm, layer.ffn_sublayer.norm)
        with torch.no_grad():
            def bias(linear: nn.Linear) -> torch.Tensor:
                b = linear.bias
                return linear.weight.new_zeros(linear.out_features) if b is None else b.detach()

            self.weights = (
                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),  # (3 d, d)
                torch.cat([bias(attn.q_proj), bias(attn.k_proj), bias(attn.v_proj)]),
                attn.out_proj.weight.detach(), bias(attn.out_proj),
                *(t for n in norms for t in (n.weight.detach(),
                                             n.weight.new_zeros(d_model) if n.bias is None else n.bias.detach())),
                ffn.linear1.weight.detach(), bias(ffn.linear1), ffn.linear2.weight.detach(), bias(ffn.linear2))
        self.d_model, self.n_heads = d_model, attn.n_heads
        self.gelu = isinstance(ffn.activation, nn.GELU)
        self.norm_first, self.eps = layer.attn_sublayer.norm_first, norms[0].eps
        self.train(layer.training)

    def __getattr__(self, name: str):
        """The layer's own parts (`self_attn`, `feed_forward`, ...), for code that reads them (hooks, inspection)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)

    @staticmethod
    def runs(layer: nn.Module) -> bool:
        """Whether the fused layer computes what `layer` does: a `MultiHeadAttention` and a `PositionwiseFeedForward`
        themselves (a subclass's `forward` may differ), linear FFN layers, ReLU or exact GELU, one eps in both norms."""
        ffn = layer.feed_forward
        norms = (layer.attn_sublayer.norm, layer.ffn_sublayer.norm)
        return (hasattr(torch, "_transformer_encoder_layer_fwd") and type(layer.self_attn) is MultiHeadAttention
                and type(ffn) is PositionwiseFeedForward and norms[0].eps == norms[1].eps
                and all(isinstance(m, nn.Linear) for m in (ffn.linear1, ffn.linear2))
                and (isinstance(ffn.activation, nn.ReLU)
                     or (isinstance(ffn.activation, nn.GELU) and ffn.activation.approximate == "none")))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, is_causal: bool = False,
                cache: AttentionCache | None = None) -> torch.Tensor:
        """(B, S, d_model) -> (B, S, d_model); the arguments as the layer's (which runs a causal or cached call)."""
        if is_causal or cache is not None or not self._takes(x, mask):
            return self.layer(x, mask, is_causal=is_causal, cache=cache)
        padding = None if mask is None else ~mask[:, 0, 0]  # (B, S) True = padding, torch's convention
        return torch._transformer_encoder_layer_fwd(
            x, self.d_model, self.n_heads, *self.weights[:4], self.gelu, self.norm_first, self.eps,
            *self.weights[4:], padding, None if padding is None else 1)  # mask type 1: key padding

    def _takes(self, x: torch.Tensor, mask: torch.Tensor | None) -> bool:
        if (self.training or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32
                or x.dim() != 3 or x.shape[0] * x.shape[1] <= FEW_ROWS_MAX or hooked(self.layer)):
            return False
        if x.shape[1] > FUSED_MAX_LENGTH or x.shape[0] * self.n_heads * x.shape[1] ** 2 * 4 > FUSED_SCORES_BYTES:
            return False  # it holds every (row, head)'s L x L scores; the layer written out runs blocked attention
        if mask is None:
            return True
        # (a sequence of padding only attends everywhere in the layer written out, and gets zeros: keep that)
        return mask.shape == (x.shape[0], 1, 1, x.shape[1]) and mask.dtype == torch.bool and bool(mask.any(-1).all())


def use_torch_encoder_layers(model: nn.Module) -> nn.Module:
    """Wrap every encoder layer of `model` that the fused layer computes in a `TorchEncoderLayer`, in place.

    Only an `EncoderLayer` itself: the fused layer computes that class's `forward`, which a subclass's may not. Not a
    decoder-only model's: its layers always run with the look-ahead mask, which the fused layer does not take."""
    if getattr(getattr(model, "config", None), "causal", False):
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is EncoderLayer and TorchEncoderLayer.runs(child):
                setattr(module, name, TorchEncoderLayer(child))
    return model
