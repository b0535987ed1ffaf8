"""int8 inference on CPU: layers stay close to float32, smoothing is safe, the choice per layer follows the
measured error, and a trained model decodes the same sentences as in float32."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends import select
from aiayn.backends.cpu import PackedLinear
from aiayn.backends.fused import StackedLinear
from aiayn.backends.int8 import (
    Bf16Linear,
    Int8Linear,
    Int8WeightsLinear,
    calibration_inputs,
    calibration_run,
    int8_range,
    int8_usable,
    onednn_int8_usable,
    quantize,
    smoothing_factors,
    step_ratio,
)
from aiayn.config import ModelConfig
from aiayn.inference import GenerationConfig, generate
from aiayn.nn.model import build_encoder, build_model

pytestmark = pytest.mark.skipif(int8_usable() is None, reason="this PyTorch build has no int8 products")
BOS, EOS, PAD = 1, 2, 0
RANGE = int8_range()  # "reduced" where int8 sums would saturate (no VNNI), or where AIAYN_INT8_RANGE asks
REDUCED = RANGE == "reduced"
# A layer's int8 error is dominated by the activation step, range / levels: bounds set for the full
# range grow by its ratio to this machine's levels.
STEP_RATIO = step_ratio(REDUCED)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def test_int8_linear_is_close_to_float32_and_smoothing_computes_the_same_map():
    weight, bias = torch.randn(48, 64) / 8, torch.randn(48)
    x = torch.randn(2, 10, 64)  # (B, L, in)
    expected = F.linear(x, weight, bias)
    with torch.no_grad():
        plain = Int8Linear(weight, bias, reduce_range=REDUCED)(x)
        smoothed = Int8Linear(weight, bias, smooth=torch.rand(64) + 0.5, reduce_range=REDUCED)(x)
    assert plain.shape == expected.shape == smoothed.shape
    bound = 0.02 * STEP_RATIO
    assert rel_error(plain, expected) < bound and rel_error(smoothed, expected) < bound
    assert not torch.equal(plain, expected)  # it really is approximate: no float path hiding behind it


def test_smoothing_moves_an_outlier_channel_into_the_weights():
    # LayerNorm outputs of trained models carry a few channels tens of times larger than the rest: one
    # scale per call then leaves the others a few levels, unless the range moves into the weights.
    weight = torch.randn(32, 64) / 8
    x = torch.randn(256, 64)
    x[:, 3] *= 60.0
    expected = F.linear(x, weight)
    with torch.no_grad():
        plain = rel_error(Int8Linear(weight, None, reduce_range=REDUCED)(x), expected)
        smoothed = rel_error(Int8Linear(weight, None, smooth=smoothing_factors(x, weight), reduce_range=REDUCED)(x),
                             expected)
    assert smoothed < plain / 2


def test_a_channel_calibration_never_saw_cannot_blow_up_the_range():
    # A ReLU unit that random calibration inputs never open has max |x| = 0 there; its factor must stay
    # bounded, or a real input that opens it overflows every other channel (this once cost 12 BLEU).
    weight = torch.randn(32, 64) / 8
    calibration = torch.relu(torch.randn(256, 64))
    calibration[:, 5] = 0.0
    real = torch.relu(torch.randn(64, 64))
    real[:, 5] = 3.0
    factors = smoothing_factors(calibration, weight)
    assert factors.max() / factors.min() < 20
    with torch.no_grad():
        assert rel_error(Int8Linear(weight, None, smooth=factors, reduce_range=REDUCED)(real),
                         F.linear(real, weight)) < 0.03 * STEP_RATIO


def test_quantize_follows_the_measured_error_per_layer():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=0)
    model = build_model(cfg).eval()
    run = calibration_run(model)
    float32 = lambda weight, bias: StackedLinear(weight, bias, F.linear)  # the layers that stay

    def choices(tolerance):
        copy = build_model(cfg).eval()
        copy.load_state_dict(model.state_dict())
        return copy, quantize(copy, run, reduce_range=REDUCED, tolerance=tolerance, fallback=float32)

    everything, all_int8 = choices(float("inf"))
    nothing, none_int8 = choices(0.0)
    assert {c.kind for c in all_int8} <= {"int8", "int8 smoothed"} and len(all_int8) == 12  # 2 layers x 6
    assert {c.kind for c in none_int8} == {"StackedLinear"}
    assert all(0 < c.int8_error < 0.1 for c in all_int8)
    assert sum(isinstance(m, Int8Linear) for m in everything.modules()) == 12
    assert not any(isinstance(m, Int8Linear) for m in nothing.modules())
    # Calibration sees every layer the forward pass calls, with (N, in) inputs.
    inputs = calibration_inputs(model, {"ffn": model.encoder.layers[0].feed_forward.linear2}, run)
    assert inputs["ffn"].shape == (8 * 32, 64)


def test_an_int8_copy_shares_nothing_it_changes_and_calibrates_any_aiayn_stack():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2)
    model = build_model(cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prepared = select("cpu", "inference", "int8").prepare(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.encoder.layers[0].feed_forward.linear1) is nn.Linear  # the model itself is untouched
    # calibrated: int8, or the float fallback where its int8 error is over the tolerance (more often on the
    # reduced range)
    assert isinstance(prepared.head.proj, (Int8Linear, Bf16Linear, Int8WeightsLinear, PackedLinear, StackedLinear))
    assert "int8" in select("cpu", "inference", "int8").describe()
    encoder = build_encoder(cfg).eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        out = select("cpu", "inference", "int8").prepare(encoder)(x)
        assert F.cosine_similarity(out.flatten(1), encoder(x).flatten(1)).min() > 0.99
    # a decoder-only model is calibrated on its own random ids too: every layer measured, none int8 blindly
    lm = build_model(dataclasses.replace(cfg, n_encoder_layers=2, n_decoder_layers=0, causal=True)).eval()
    run = calibration_run(lm)
    assert run is not None
    float32 = lambda weight, bias: StackedLinear(weight, bias, F.linear)
    choices = quantize(copy.deepcopy(lm), run, reduce_range=REDUCED, fallback=float32)
    assert len(choices) == 2 * 6 + 1 and all(math.isfinite(c.int8_error) for c in choices)  # 2 layers x 6, the head


def _copy_task_model() -> nn.Module:
    """A tiny encoder-decoder trained to copy sequences of 3-7 tokens (a few seconds on one thread)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=24, d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2, n_decoder_layers=2,
                      dropout=0.0, max_len=16)
    model = build_model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    # decayed to zero: at a constant rate the last steps' noise decides how much it learned (29-39 of 40 copied
    # by one CPU's arithmetic or another's); decayed, 34-40 on AVX-512 and AVX2 over four seeds
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 250)
    for _ in range(250):
        length = int(torch.randint(3, 8, ()))
        src = torch.randint(4, 24, (64, length))
        tgt = torch.cat([torch.full((64, 1), BOS), src, torch.full((64, 1), EOS)], dim=1)
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 24), tgt[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return model.eval()


def test_a_trained_model_decodes_the_same_in_int8():
    model = _copy_task_model()
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, 24, (40, 6), generator=gen)
    int8 = select("cpu", "inference", "int8").prepare(model)
    for beam in (1, 4):
        config = GenerationConfig(max_new_tokens=8, num_beams=beam)
        expected = generate(model, src, bos_id=BOS, eos_id=EOS, config=config).tokens
        actual = generate(int8, src, bos_id=BOS, eos_id=EOS, config=config).tokens
        assert sum(e == src_row.tolist() for e, src_row in zip(expected, src)) >= 30  # it learned the task
        agreement = sum(a == e for a, e in zip(actual, expected)) / len(expected)
        assert agreement >= 0.95, (beam, agreement)


def test_the_reduced_range_can_be_asked_for(monkeypatch):
    monkeypatch.setenv("AIAYN_INT8_RANGE", "reduced")
    assert int8_range() == "reduced"


@torch.no_grad()
def test_int8_weights_compute_the_product_and_leave_other_rows_to_the_fallback():
    from aiayn.backends.int8 import choose, int8_weights_usable

    if not int8_weights_usable():
        pytest.fail("this torch build has no int8-weight product on CPU (torch._weight_int8pack_mm)")
    weight, bias = torch.randn(48, 64) / 8, torch.randn(48)
    fallback = nn.Linear(64, 48)
    layer = Int8WeightsLinear(weight, bias, rows=frozenset({"one", "few"}), fallback=fallback)
    for rows in (1, 4):
        x = torch.randn(rows, 1, 64)
        expected = F.linear(x, weight, bias)
        # int8 weights (a step of max|w_row| / 127) and bf16 inputs (8-bit mantissa): well within 2% here
        assert ((layer(x) - expected).norm() / expected.norm()) < 0.02
    many = torch.randn(32, 64)
    assert torch.equal(layer(many), fallback(many))  # an encoder's many rows: the float32 kernel
    # choose: over int8's tolerance, int8 weights where measured faster, else the fallback
    x = torch.randn(256, 64)
    module = nn.Linear(64, 48)
    float32 = lambda weight, bias: StackedLinear(weight, bias, F.linear)  # noqa: E731
    ran, choice = choose("w", module, x, reduce_range=REDUCED, tolerance=0.0, fallback=float32,
                         int8_weights_rows={"one": {"wide": False, "square": False, "narrow": True}})
    assert isinstance(ran, Int8WeightsLinear) and choice.kind == "int8 weights" and ran.rows == {"one"}
    ran, choice = choose("w", module, x, reduce_range=REDUCED, tolerance=0.0, fallback=float32,
                         int8_weights_rows={"one": {"narrow": False}})
    assert isinstance(ran, StackedLinear) and choice.kind == "StackedLinear"


def test_an_int8_layer_runs_float32_on_the_rows_where_int8_was_measured_slower():
    # fbgemm quantises its input on every call: at few rows of a narrow model that costs more than the float32
    # product, and the calibration says where (`calibrate.int8_kernels`); there the layer runs float32.
    from aiayn.backends.int8 import Float32Rows, choose

    module = nn.Linear(64, 48)  # a narrowing product
    x = torch.randn(256, 64)
    float32 = lambda weight, bias: StackedLinear(weight, bias, F.linear)  # noqa: E731
    layer, choice = choose("w", module, x, reduce_range=REDUCED, tolerance=1.0, fallback=None,
                           float32=Float32Rows({"one": {"narrow": True}, "few": {"narrow": True},
                                                "many": {"wide": True}}, float32))
    assert isinstance(layer, Int8Linear) and choice.kind.startswith("int8") and layer.float32_rows == {"one", "few"}
    with torch.no_grad():
        for rows in (1, 4):
            one = torch.randn(rows, 64)
            assert torch.equal(layer(one), F.linear(one, module.weight, module.bias))  # float32 itself
        many = torch.randn(32, 64)
        int8_out = layer(many)
        assert not torch.equal(int8_out, F.linear(many, module.weight, module.bias))  # int8 there
        assert rel_error(int8_out, F.linear(many, module.weight, module.bias)) < 0.05 * STEP_RATIO
    plain, _ = choose("w", module, x, reduce_range=REDUCED, tolerance=1.0, fallback=None)
    assert plain.float32 is None and "float32 rows" not in repr(plain)


@pytest.mark.skipif(not onednn_int8_usable(), reason="this build has no oneDNN int8 product here")
def test_an_int8_layer_runs_onednns_product_on_the_rows_measured_faster():
    # On a CPU with AMX, oneDNN's int8 product runs on its tiles where fbgemm's stops at VNNI; it quantises the
    # input as fbgemm does, so the two compute the same values up to the order of the sums.
    from aiayn.backends.int8 import choose

    module = nn.Linear(64, 48)
    x = torch.randn(256, 64)
    layer, choice = choose("w", module, x, reduce_range=REDUCED, tolerance=1.0, fallback=None,
                           onednn_rows={"many": {"narrow": True}, "one": {"wide": True}})
    assert isinstance(layer, Int8Linear) and layer.onednn_rows == {"many"} and "oneDNN rows=many" in repr(layer)
    with torch.no_grad():
        for shape in ((32, 64), (2, 16, 64)):
            many = torch.randn(*shape)
            assert layer.product("many") == layer.onednn_product
            assert torch.allclose(layer(many), layer.int8_product(many), rtol=1e-4, atol=1e-4)
            assert rel_error(layer(many), F.linear(many, module.weight, module.bias)) < 0.05 * STEP_RATIO
        one = torch.randn(1, 64)
        assert layer.product("one") == layer.int8_product and torch.equal(layer(one), layer.int8_product(one))
        # no range to quantise over: fbgemm's product, as where oneDNN's is not chosen
        assert layer.onednn_product(torch.zeros(0, 64)).shape == (0, 48)
        infinite = torch.randn(32, 64)
        infinite[0, 0] = float("inf")
        assert torch.equal(layer.onednn_product(infinite).isnan(), layer.int8_product(infinite).isnan())


def test_select_runs_an_int8_copy_in_float32_where_its_widths_measured_int8_slower(monkeypatch):
    from aiayn.backends import backend as backend_module
    from aiayn.backends.backend import inference_shape

    model = build_model(ModelConfig(vocab_size=200, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1,
                                    n_decoder_layers=1, dropout=0.0, max_len=32)).eval()
    measured = {"one": {"wide": "float32", "square": "float32", "narrow": "int8", "vocabulary": "int8"},
                "few": {"wide": "int8", "square": "float32", "narrow": "int8", "vocabulary": "int8"},
                "many": dict.fromkeys(("wide", "square", "narrow", "vocabulary"), "int8")}
    asked = []
    monkeypatch.setattr(backend_module.calibrate, "int8_kernels", lambda *shape: asked.append(shape) or measured)
    backend = select("cpu", "inference", "int8", inference_shape=inference_shape(model))
    assert asked == [inference_shape(model)]
    assert set(backend.int8_float32) == {("one", "wide"), ("one", "square"), ("few", "square")}
    assert "float32 products where measured faster than int8" in backend.describe()
    prepared = backend.prepare(model)
    qkv = prepared.decoder.layers[0].self_attn.qkv  # 32 -> 96: wide
    out = prepared.decoder.layers[0].self_attn.out_proj  # square
    if isinstance(qkv, Int8Linear):
        assert qkv.float32_rows == {"one"}
    if isinstance(out, Int8Linear):
        assert out.float32_rows == {"one", "few"}
    assert isinstance(qkv, Int8Linear) or isinstance(out, Int8Linear)  # at least one stayed int8 at this size
    # no cross-attention absorbed into the memory over float32 weights: the flat step would then compute another
    # arithmetic than the modules' path (recorded attention, hooks), which runs the int8 projections
    assert not backend.absorbed_cross
    # a copy without a measured shape takes a base model's
    select("cpu", "inference", "int8")
    assert asked[-1] == backend_module.BASE_INFERENCE_SHAPE


def test_where_int8_products_pay_is_measured_once_at_a_models_widths(tmp_path, monkeypatch, quiet_cores):
    """int8 products and products over int8 weights are timed at a narrow model's own widths, once, without a base
    model's shapes."""
    from aiayn.backends import calibrate, int8, timing

    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "_chosen", {})
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("a base model's shapes measured"))
    pays = calibrate.int8_kernels(32, 64, 200, 1 << 20)
    assert set(pays) == {"one", "few", "many"} and all(set(k) == {"wide", "square", "narrow", "vocabulary"}
                                                       and set(k.values()) <= {"int8", "int8 onednn", "float32"}
                                                       for k in pays.values())
    weights = calibrate.int8_weight_choices(32, 64, 200, 1 << 20)
    found = calibrate._measured_so_far()
    assert found.int8_widths == {"32x64x200": pays} and "int8 one square 32x64x200: float32" in found.ratios
    assert "int8 at 32x64x200 (\"int8\": fbgemm's): one row: wide " in found.describe()  # each kernel, its margin
    if int8.onednn_int8_usable():
        assert "int8 one square 32x64x200: int8 onednn" in found.ratios
    assert found.int8_weights_widths == {"32x64x200": weights} and found.int8_weights is None
    if int8.int8_weights_usable():
        assert set(weights) == {"one", "few"} and "int8 weights one square 32x64x200: float32" in found.seconds
    select("cpu", "inference", "int8", inference_shape=(32, 64, 200, 1 << 20))  # measures nothing more
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process: read from the cache file
    monkeypatch.setattr(calibrate, "_int8_products", lambda *args, **kwargs: pytest.fail("measured again"))
    monkeypatch.setattr(calibrate, "_int8_weights", lambda *args, **kwargs: pytest.fail("measured again"))
    assert calibrate.int8_kernels(32, 64, 200, 1 << 20) == pays
    assert calibrate.int8_weight_choices(32, 64, 200, 1 << 20) == weights
