"""PyTorch's fused encoder layer as a backend path: equal to the layer written out, used only where it computes
the same and where calibration measured it faster, and out of the way of anything that looks inside the layer."""

import dataclasses

import pytest
import torch

from aiayn.backends import calibrate, select
from aiayn.backends.fused import TorchEncoderLayer, use_torch_encoder_layers
from aiayn.config import ModelConfig
from aiayn.nn.attention import attention_weights
from aiayn.nn.model import build_encoder, build_model

LAYER = dict(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=1, max_len=64,
             dropout=0.0)


def encoder(**overrides):
    torch.manual_seed(0)
    return build_encoder(ModelConfig(**{**LAYER, **overrides})).eval()


def padded(batch: int = 4, length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, length, LAYER["d_model"])
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    mask[1, ..., 5:] = False
    mask[3, ..., 2:] = False
    return x, mask


@pytest.fixture
def op_calls(monkeypatch):
    """How many times PyTorch's fused layer ran."""
    calls = []
    fused = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a: (calls.append(1), fused(*a))[1])
    return calls


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@torch.no_grad()
def test_the_fused_layer_equals_the_layer_written_out(norm_first, activation, bias, op_calls):
    plain = encoder(norm_first=norm_first, activation=activation, bias=bias)
    fused = use_torch_encoder_layers(select("cpu", plain=True).prepare(plain))
    assert all(type(layer) is TorchEncoderLayer for layer in fused.layers)
    x, mask = padded()
    for m in (None, mask):
        torch.testing.assert_close(fused(x, m), plain(x, m), atol=1e-5, rtol=1e-5)
    assert len(op_calls) == 2 * len(plain.layers)


@torch.no_grad()
def test_calls_it_cannot_take_run_the_layer_written_out(op_calls):
    plain = encoder()
    fused = use_torch_encoder_layers(select("cpu", plain=True).prepare(plain))
    x, mask = padded()
    empty = mask.clone()
    empty[2] = False  # a sequence of padding only: the layer written out attends everywhere and gets zeros
    few = x[:1, :4]  # 4 rows: the products measured for few rows, not PyTorch's fused layer
    long = torch.randn(1, 300, LAYER["d_model"])  # longer than FUSED_MAX_LENGTH: blocked attention
    for args in ((x, empty), (few, None), (long, None)):
        torch.testing.assert_close(fused(*args), plain(*args), atol=1e-5, rtol=1e-5)
    with torch.enable_grad():
        out = fused(x.requires_grad_(), mask)
    assert out.requires_grad
    assert op_calls == []


@torch.no_grad()
def test_training_mode_runs_the_layer_written_out(op_calls):
    # (found in review) without gradients but in training mode, as Monte-Carlo dropout runs: the layer written out
    # applies its dropout, the fused layer (whose own fast path requires eval mode) would apply none
    torch.manual_seed(0)
    plain = build_encoder(ModelConfig(**{**LAYER, "dropout": 0.5, "attention_dropout": 0.5}))
    fused = use_torch_encoder_layers(select("cpu", plain=True).prepare(plain))
    plain.train(), fused.train()
    x = torch.randn(4, 9, LAYER["d_model"])
    torch.manual_seed(1)
    expected = plain(x)
    torch.manual_seed(1)
    torch.testing.assert_close(fused(x), expected)
    assert op_calls == []


@torch.no_grad()
def test_recorded_attention_and_hooks_see_the_layer_written_out(op_calls):
    plain = encoder()
    fused = use_torch_encoder_layers(select("cpu", plain=True).prepare(plain))
    x, mask = padded()
    assert fused.layers[0].self_attn is fused.layers[0].layer.self_attn  # the layer's parts, for code that reads them
    with attention_weights([layer.self_attn for layer in fused.layers]) as theirs:
        out = fused(x, mask)
    with attention_weights([layer.self_attn for layer in plain.layers]) as ours:
        expected = plain(x, mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    seen = []
    handle = fused.layers[1].feed_forward.register_forward_hook(lambda *_: seen.append(1))
    fused(x, mask)
    handle.remove()
    assert seen == [1] and op_calls == [1]  # the first layer fused, the hooked one written out
    fused(x, mask)
    assert op_calls == [1, 1, 1]


def test_only_what_it_computes_is_wrapped():
    assert not any(type(layer) is TorchEncoderLayer
                   for layer in use_torch_encoder_layers(encoder(activation="gelu_tanh")).layers)


@pytest.mark.parametrize("chosen", [True, False])
@torch.no_grad()
def test_select_uses_it_where_calibration_measured_it_faster(chosen, measured, op_calls):
    measured(many="dense", torch_layers=chosen)
    backend = select("cpu", "inference", "fp32")
    assert backend.torch_layers is chosen
    assert ("PyTorch's fused encoder layers" in backend.describe()) is chosen
    op_calls.clear()  # (this machine's own calibration ran it too)
    plain = encoder()
    x, mask = padded()
    torch.testing.assert_close(backend.prepare(plain)(x, mask), plain(x, mask), atol=1e-5, rtol=1e-5)
    assert len(op_calls) == (len(plain.layers) if chosen else 0)
    assert not select("cpu", "train").torch_layers  # training runs the layer written out


def test_calibration_measures_it_and_says_so(op_calls):
    seconds: dict[str, float] = {}
    inference = calibrate.by_shape({"one": "dense", "few": "dense", "many": "dense"})
    with torch.no_grad():  # as `measure` runs it
        chosen = calibrate._torch_layers_inference(inference, False, seconds)
    assert op_calls  # it timed PyTorch's fused layer, not the layer written out twice
    assert set(seconds) == {"encoder layer: aiayn", "encoder layer: torch"} and isinstance(chosen, bool)
    choices = dataclasses.replace(calibrate.choices(), torch_layers_inference=chosen, seconds={
        **calibrate.choices().seconds, **seconds})
    assert "PyTorch's fused encoder layer: " + ("yes" if chosen else "no") in choices.describe()


def test_a_decoder_only_model_keeps_its_layers():
    """Its layers always run with the look-ahead mask, which the fused layer does not take: no wrapper, no copy."""
    cfg = ModelConfig(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=0,
                      causal=True, dropout=0.0)
    model = use_torch_encoder_layers(build_model(cfg).eval())
    assert not any(isinstance(m, TorchEncoderLayer) for m in model.modules())
