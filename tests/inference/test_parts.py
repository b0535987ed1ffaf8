"""A decoder's parts as plain functions (`aiayn.inference.parts`): each computes what its module computes, for the
row class it was made for, and a module it does not know runs its own `forward`."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends import select
from aiayn.backends.cpu import PackedFeedForward, PackedLinear, onednn_usable
from aiayn.backends.fused import SINGLE_QUERY_WRITTEN_OUT, FusedQKVAttention
from aiayn.backends.int8 import Int8Linear
from aiayn.config import ModelConfig
from aiayn.inference import parts
from aiayn.inference.steps import StaticState
from aiayn.nn.attention import MultiHeadAttention, attention_bias
from aiayn.nn.feedforward import PositionwiseFeedForward
from aiayn.nn.model import build_model

needs_onednn = pytest.mark.skipif(not onednn_usable(), reason="this build or CPU does not run oneDNN's products")
ROWS = {"one": 1, "few": 5, "many": 40}


@needs_onednn
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@torch.no_grad()
def test_a_packed_layers_function_is_its_kernel_for_each_row_class(activation):
    weight, bias = torch.randn(48, 32), torch.randn(48)
    layer = PackedLinear(weight, bias, activation=activation, kernels={"one": "columns", "few": "dense",
                                                                        "many": "packed"})
    for rows in ROWS.values():
        x = torch.randn(rows, 1, 32)
        torch.testing.assert_close(parts.product(layer, rows)(x), layer(x), atol=0, rtol=0)


@torch.no_grad()
def test_an_int8_layer_runs_float32_on_the_row_classes_measured_so_and_int8_elsewhere():
    weight, bias = torch.randn(24, 16), torch.randn(24)
    float32 = nn.Linear(16, 24)
    float32.weight.copy_(weight), float32.bias.copy_(bias)
    layer = Int8Linear(weight, bias).on_float32(frozenset({"one"}), float32)
    one, few = torch.randn(1, 1, 16), torch.randn(5, 1, 16)
    torch.testing.assert_close(parts.product(layer, 1)(one), F.linear(one, weight, bias), atol=0, rtol=0)
    assert parts.product(layer, 5) == layer.int8_product
    torch.testing.assert_close(parts.product(layer, 5)(few), layer(few), atol=0, rtol=0)


@torch.no_grad()
def test_plain_layers_norms_and_heads_compute_what_their_modules_do():
    linear, norm, rms = nn.Linear(16, 8), nn.LayerNorm(16, eps=1e-6), nn.RMSNorm(16)
    x = torch.randn(3, 1, 16)
    torch.testing.assert_close(parts.product(linear, 3)(x), linear(x), atol=0, rtol=0)
    torch.testing.assert_close(parts.norm(norm)(x), norm(x), atol=0, rtol=0)
    assert parts.norm(rms) == rms.forward  # a norm it does not know: the module's own
    model = build_model(ModelConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                                    n_decoder_layers=1, max_len=16)).eval()
    torch.testing.assert_close(parts.head(model.head, 3)(x[:, 0]), model.head(x[:, 0]), atol=0, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
@torch.no_grad()
def test_a_feed_forward_is_its_two_products_where_its_dropout_drops_nothing(packed):
    ffn = PositionwiseFeedForward(16, 32, activation="gelu", dropout=0.5).eval()
    if packed:
        if not onednn_usable():
            pytest.skip("this build or CPU does not run oneDNN's products")
        ffn.linear1 = PackedLinear(ffn.linear1.weight, ffn.linear1.bias)
        ffn.linear2 = PackedLinear(ffn.linear2.weight, ffn.linear2.bias)
        ffn = PackedFeedForward(ffn, "gelu")
    x = torch.randn(5, 1, 16)
    torch.testing.assert_close(parts.feed_forward(ffn, 5)(x), ffn(x), atol=0, rtol=0)
    ffn.train()  # its dropout now drops: the module's own forward, dropout and all
    assert parts.feed_forward(ffn, 5) == ffn.forward


@pytest.mark.parametrize("fused", [False, True])
@torch.no_grad()
def test_attention_is_sdpa_or_written_out_as_the_layer_would_run_it(fused):
    attn = MultiHeadAttention(64, 2).eval()
    if fused:
        attn = FusedQKVAttention.from_attention(attn, product=F.linear, frozen=None)
    run = parts.attention(attn)
    rows = SINGLE_QUERY_WRITTEN_OUT  # x 2 heads: written out by a fused layer, over 20 keys of 32
    q, k, v = torch.randn(rows, 2, 1, 32), torch.randn(rows, 2, 20, 32), torch.randn(rows, 2, 20, 32)
    allowed = torch.ones(rows, 1, 1, 20, dtype=torch.bool)
    allowed[0, ..., 12:] = False
    for mask in (None, attention_bias(allowed, torch.float32)):
        expected = attn.attend(q, k, v, mask, dropout_p=0.0, need_weights=False)[0]
        torch.testing.assert_close(run(q, k, v, mask), expected, atol=0, rtol=0)
    allowed[1] = False  # a query with nothing to attend to: a bool mask, through `attend`, which zeroes it
    out = run(q, k, v, allowed)
    torch.testing.assert_close(out, attn.attend(q, k, v, allowed, dropout_p=0.0, need_weights=False)[0])
    assert out[1].abs().max() == 0
    # a sentence's 4 beams as the queries of its memory: written out in a step where the layer runs SDPA, equal
    beams = torch.randn(rows, 2, 4, 32)
    bias = attention_bias(torch.ones(rows, 1, 1, 20, dtype=torch.bool), torch.float32)
    expected = attn.attend(beams, k, v, bias, dropout_p=0.0, need_weights=False)[0]
    torch.testing.assert_close(run(beams, k, v, bias), expected, atol=1e-5, rtol=0)
    flash = {e.name for e in _profiled(lambda: run(beams, k, v, bias))}
    assert any("flash" in name for name in flash) != fused


def _profiled(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.events()


@pytest.mark.parametrize("how", ["plain", "fp32"])
@torch.no_grad()
def test_a_step_makes_its_parts_once_per_row_class(how):
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1,
                                    n_decoder_layers=2, max_len=64, dropout=0.0)).eval()
    model = model if how == "plain" else select("cpu", "inference", how).prepare(model)
    state = StaticState(model, torch.randint(4, 50, (20, 6)), 8)
    for rows in (20, 20, 18, 5, 4, 1):  # many, many, many, few, few, one: sentences leave the batch
        if rows < state.cache.shape[2]:
            state.reorder(torch.arange(rows), memory_rows=torch.arange(rows))
        state.step(torch.randint(4, 50, (rows, 1)))
    assert set(state.plans) == {"one", "few", "many"}
