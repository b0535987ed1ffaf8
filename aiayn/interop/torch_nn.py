"""aiayn's layers and stacks as PyTorch's own `torch.nn.Transformer*` modules with the same weights.

These are the oracles of the layer tests and of `aiayn verify`: PyTorch's implementation of the
same paper, built with the same options (post-LN or pre-LN, ReLU or GELU, bias, eps) and given
aiayn's weights. One difference in conventions is the caller's to bridge: torch's key padding masks
are True for "ignore", aiayn's masks True for "may attend".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.config import ModelConfig
from aiayn.nn.attention import MultiHeadAttention
from aiayn.nn.layers import DecoderLayer, EncoderLayer
from aiayn.nn.model import Decoder, Encoder


def _activation(name: str):
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return name  # "relu" and "gelu" are torch's own names


def torch_encoder_layer(cfg: ModelConfig) -> nn.TransformerEncoderLayer:
    """A `TransformerEncoderLayer` configured like aiayn's encoder layers for `cfg` (batch first)."""
    return nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, cfg.d_ff, dropout=cfg.dropout,
                                      activation=_activation(cfg.activation), layer_norm_eps=cfg.layer_norm_eps,
                                      batch_first=True, norm_first=cfg.norm_first, bias=cfg.bias)


def torch_decoder_layer(cfg: ModelConfig) -> nn.TransformerDecoderLayer:
    """A `TransformerDecoderLayer` configured like aiayn's decoder layers for `cfg` (batch first)."""
    return nn.TransformerDecoderLayer(cfg.d_model, cfg.n_heads, cfg.d_ff, dropout=cfg.dropout,
                                      activation=_activation(cfg.activation), layer_norm_eps=cfg.layer_norm_eps,
                                      batch_first=True, norm_first=cfg.norm_first, bias=cfg.bias)


@torch.no_grad()
def copy_attention(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    """Q, K, V go into torch's stacked `in_proj` (rows: Q, then K, then V); the output projection as is."""
    theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
    if theirs.in_proj_bias is not None:
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    theirs.out_proj.load_state_dict(ours.out_proj.state_dict())


def copy_encoder_layer(ours: EncoderLayer, theirs: nn.TransformerEncoderLayer) -> None:
    """Copy one encoder layer's weights into torch's."""
    copy_attention(ours.self_attn, theirs.self_attn)
    theirs.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
    theirs.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
    theirs.norm1.load_state_dict(ours.attn_sublayer.norm.state_dict())
    theirs.norm2.load_state_dict(ours.ffn_sublayer.norm.state_dict())


def copy_decoder_layer(ours: DecoderLayer, theirs: nn.TransformerDecoderLayer) -> None:
    """Copy one decoder layer's weights into torch's (cross-attention is torch's `multihead_attn`)."""
    copy_attention(ours.self_attn, theirs.self_attn)
    copy_attention(ours.cross_attn, theirs.multihead_attn)
    theirs.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
    theirs.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
    theirs.norm1.load_state_dict(ours.self_attn_sublayer.norm.state_dict())
    theirs.norm2.load_state_dict(ours.cross_attn_sublayer.norm.state_dict())
    theirs.norm3.load_state_dict(ours.ffn_sublayer.norm.state_dict())


def _final_norm(cfg: ModelConfig, stack: Encoder | Decoder) -> nn.LayerNorm | None:
    # torch's pre-LN stacks end with a LayerNorm only when given one, as aiayn's always do for pre-LN.
    if stack.final_norm is None:
        return None
    norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
    norm.load_state_dict(stack.final_norm.state_dict())
    return norm


def to_torch_encoder(encoder: Encoder, cfg: ModelConfig, *, enable_nested_tensor: bool = False
                     ) -> nn.TransformerEncoder:
    """A `TransformerEncoder` with `encoder`'s weights (in eval mode when `encoder` is)."""
    theirs = nn.TransformerEncoder(torch_encoder_layer(cfg), len(encoder.layers), norm=_final_norm(cfg, encoder),
                                   enable_nested_tensor=enable_nested_tensor and not cfg.norm_first)
    for mine, other in zip(encoder.layers, theirs.layers):
        copy_encoder_layer(mine, other)
    return theirs.train(encoder.training)


def to_torch_decoder(decoder: Decoder, cfg: ModelConfig) -> nn.TransformerDecoder:
    """A `TransformerDecoder` with `decoder`'s weights (in eval mode when `decoder` is)."""
    theirs = nn.TransformerDecoder(torch_decoder_layer(cfg), len(decoder.layers), norm=_final_norm(cfg, decoder))
    for mine, other in zip(decoder.layers, theirs.layers):
        copy_decoder_layer(mine, other)
    return theirs.train(decoder.training)
