"""Encoder and decoder layers and stacks equal PyTorch's own Transformer modules with copied weights.

Oracle: `torch.nn.TransformerEncoderLayer` / `TransformerEncoder` / `TransformerDecoderLayer` /
`TransformerDecoder`, eval mode, atol 1e-5, on the plain modules and on the CPU backend's prepared
copy (`run_on`). Torch's key_padding_mask is True = ignore; ours is True = may attend, so the masks
are inverted at the boundary.
"""

import pytest
import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.nn.attention import MultiHeadAttention
from aiayn.nn.model import build_decoder, build_encoder

ATOL = 1e-5
VARIANTS = [(False, "relu"), (False, "gelu"), (True, "relu"), (True, "gelu")]
IDS = ["post-LN-relu", "post-LN-gelu", "pre-LN-relu", "pre-LN-gelu"]


def tiny(norm_first: bool, activation: str) -> ModelConfig:
    return ModelConfig(vocab_size=50, d_model=16, n_heads=4, d_ff=32, n_encoder_layers=3, n_decoder_layers=3,
                       norm_first=norm_first, activation=activation, dropout=0.1, max_len=64)


def copy_attention(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)


def copy_encoder_layer(ours, theirs: nn.TransformerEncoderLayer) -> None:
    copy_attention(ours.self_attn, theirs.self_attn)
    theirs.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
    theirs.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
    theirs.norm1.load_state_dict(ours.attn_sublayer.norm.state_dict())
    theirs.norm2.load_state_dict(ours.ffn_sublayer.norm.state_dict())


def copy_decoder_layer(ours, theirs: nn.TransformerDecoderLayer) -> None:
    copy_attention(ours.self_attn, theirs.self_attn)
    copy_attention(ours.cross_attn, theirs.multihead_attn)
    theirs.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
    theirs.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
    theirs.norm1.load_state_dict(ours.self_attn_sublayer.norm.state_dict())
    theirs.norm2.load_state_dict(ours.cross_attn_sublayer.norm.state_dict())
    theirs.norm3.load_state_dict(ours.ffn_sublayer.norm.state_dict())


def randomise(module: nn.Module) -> None:
    """Random LayerNorm gains/biases and projection biases too, so that a mis-copied one shows."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3)


def torch_encoder_layer(cfg: ModelConfig) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, cfg.d_ff, dropout=cfg.dropout,
                                      activation=cfg.activation, layer_norm_eps=cfg.layer_norm_eps,
                                      batch_first=True, norm_first=cfg.norm_first)


def torch_decoder_layer(cfg: ModelConfig) -> nn.TransformerDecoderLayer:
    return nn.TransformerDecoderLayer(cfg.d_model, cfg.n_heads, cfg.d_ff, dropout=cfg.dropout,
                                      activation=cfg.activation, layer_norm_eps=cfg.layer_norm_eps,
                                      batch_first=True, norm_first=cfg.norm_first)


def real_tokens(batch: int, length: int, lengths: list[int]) -> torch.Tensor:
    """(B, L) bool, True for the first lengths[b] positions of row b (right padding)."""
    return torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padding"])
@pytest.mark.parametrize(("norm_first", "activation"), VARIANTS, ids=IDS)
def test_encoder_layer_equals_torch(norm_first, activation, padded, run_on):
    cfg = tiny(norm_first, activation)
    ours = build_encoder(cfg).layers[0]
    randomise(ours)
    theirs = torch_encoder_layer(cfg)
    copy_encoder_layer(ours, theirs)
    ours.eval(), theirs.eval()
    ours = run_on(ours)
    x = torch.randn(3, 7, cfg.d_model)
    keep = real_tokens(3, 7, [7, 4, 1]) if padded else torch.ones(3, 7, dtype=torch.bool)
    expected = theirs(x, src_key_padding_mask=~keep if padded else None)
    with torch.no_grad():
        actual = ours(x, keep[:, None, None, :] if padded else None)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padding"])
@pytest.mark.parametrize(("norm_first", "activation"), VARIANTS, ids=IDS)
def test_encoder_stack_equals_torch(norm_first, activation, padded, run_on):
    cfg = tiny(norm_first, activation)
    ours = build_encoder(cfg)
    randomise(ours)
    # torch's pre-LN stack ends with a LayerNorm only when given one, as ours always does for pre-LN.
    final = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if norm_first else None
    theirs = nn.TransformerEncoder(torch_encoder_layer(cfg), cfg.n_encoder_layers, norm=final,
                                   enable_nested_tensor=not norm_first)
    for mine, other in zip(ours.layers, theirs.layers):
        copy_encoder_layer(mine, other)
    if norm_first:
        final.load_state_dict(ours.final_norm.state_dict())
    ours.eval(), theirs.eval()
    ours = run_on(ours)
    x = torch.randn(3, 6, cfg.d_model)
    keep = real_tokens(3, 6, [6, 3, 2]) if padded else torch.ones(3, 6, dtype=torch.bool)
    torch_mask = ~keep if padded else None
    our_mask = keep[:, None, None, :] if padded else None
    expected = theirs(x, src_key_padding_mask=torch_mask)
    with torch.no_grad():
        actual = ours(x, our_mask)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
    # Under inference_mode torch takes its fused fast path (nested tensors for post-LN with padding),
    # which leaves padded positions at zero: compare the real tokens.
    with torch.inference_mode():
        expected, actual = theirs(x, src_key_padding_mask=torch_mask), ours(x, our_mask)
    torch.testing.assert_close(actual[keep], expected[keep], atol=ATOL, rtol=0)


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padding"])
@pytest.mark.parametrize(("norm_first", "activation"), VARIANTS, ids=IDS)
def test_decoder_layer_equals_torch(norm_first, activation, padded, run_on):
    cfg = tiny(norm_first, activation)
    ours = build_decoder(cfg).layers[0]
    randomise(ours)
    theirs = torch_decoder_layer(cfg)
    copy_decoder_layer(ours, theirs)
    ours.eval(), theirs.eval()
    ours = run_on(ours)
    x, memory = torch.randn(3, 5, cfg.d_model), torch.randn(3, 6, cfg.d_model)
    src_keep = real_tokens(3, 6, [6, 2, 4]) if padded else torch.ones(3, 6, dtype=torch.bool)
    tgt_keep = real_tokens(3, 5, [5, 5, 3]) if padded else torch.ones(3, 5, dtype=torch.bool)
    look_ahead = torch.ones(5, 5, dtype=torch.bool).triu(1)  # torch: True = may NOT attend
    expected = theirs(x, memory, tgt_mask=look_ahead, tgt_is_causal=True,
                      tgt_key_padding_mask=~tgt_keep if padded else None,
                      memory_key_padding_mask=~src_keep if padded else None)
    with torch.no_grad():
        actual = ours(x, memory, tgt_mask=tgt_keep[:, None, None, :] if padded else None,
                      memory_mask=src_keep[:, None, None, :] if padded else None)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("norm_first", "activation"), [(False, "relu"), (True, "gelu")], ids=["post-LN", "pre-LN"])
def test_decoder_stack_equals_torch(norm_first, activation, run_on):
    cfg = tiny(norm_first, activation)
    ours = build_decoder(cfg)
    randomise(ours)
    final = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if norm_first else None
    theirs = nn.TransformerDecoder(torch_decoder_layer(cfg), cfg.n_decoder_layers, norm=final)
    for mine, other in zip(ours.layers, theirs.layers):
        copy_decoder_layer(mine, other)
    if norm_first:
        final.load_state_dict(ours.final_norm.state_dict())
    ours.eval(), theirs.eval()
    ours = run_on(ours)
    x, memory = torch.randn(2, 5, cfg.d_model), torch.randn(2, 4, cfg.d_model)
    src_keep = real_tokens(2, 4, [4, 2])
    expected = theirs(x, memory, tgt_mask=torch.ones(5, 5, dtype=torch.bool).triu(1), tgt_is_causal=True,
                      memory_key_padding_mask=~src_keep)
    with torch.no_grad():
        actual = ours(x, memory, memory_mask=src_keep[:, None, None, :])
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
