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
from aiayn.interop.torch_nn import (
    copy_decoder_layer,
    copy_encoder_layer,
    to_torch_decoder,
    to_torch_encoder,
    torch_decoder_layer,
    torch_encoder_layer,
)
from aiayn.nn.model import build_decoder, build_encoder

ATOL = 1e-5
VARIANTS = [(False, "relu"), (False, "gelu"), (True, "relu"), (True, "gelu")]
IDS = ["post-LN-relu", "post-LN-gelu", "pre-LN-relu", "pre-LN-gelu"]


def tiny(norm_first: bool, activation: str) -> ModelConfig:
    return ModelConfig(vocab_size=50, d_model=16, n_heads=4, d_ff=32, n_encoder_layers=3, n_decoder_layers=3,
                       norm_first=norm_first, activation=activation, dropout=0.1, max_len=64)


def randomise(module: nn.Module) -> None:
    """Random LayerNorm gains/biases and projection biases too, so that a mis-copied one shows."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3)


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
    theirs = to_torch_encoder(ours, cfg, enable_nested_tensor=True)
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
    theirs = to_torch_decoder(ours, cfg)
    ours.eval(), theirs.eval()
    ours = run_on(ours)
    x, memory = torch.randn(2, 5, cfg.d_model), torch.randn(2, 4, cfg.d_model)
    src_keep = real_tokens(2, 4, [4, 2])
    expected = theirs(x, memory, tgt_mask=torch.ones(5, 5, dtype=torch.bool).triu(1), tgt_is_causal=True,
                      memory_key_padding_mask=~src_keep)
    with torch.no_grad():
        actual = ours(x, memory, memory_mask=src_keep[:, None, None, :])
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
