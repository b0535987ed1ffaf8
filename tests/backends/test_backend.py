"""The backend layer: it picks what this machine can use, prepares a model once, and stays equal to the plain path."""

import dataclasses
import json
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from aiayn.backends import (
    available_devices,
    bf16_supported,
    calibrate,
    cpu,
    inference_shape,
    resolve_device,
    select,
    timing,
)
from aiayn.backends import backend as backend_module
from aiayn.backends.cpu import OneDnnLinear, PackedFeedForward, PackedLinear, onednn_linear, onednn_usable
from aiayn.backends.fused import FusedQKVAttention, stacked_away
from aiayn.backends.shapes import row_class, shape_kind
from aiayn.config import ModelConfig, preset
from aiayn.inference import GenerationConfig, generate
from aiayn.nn.attention import MultiHeadAttention
from aiayn.nn.model import build_encoder, build_model
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.objectives import forward

BF16_TRAINING_FASTER = calibrate.bf16_training_faster  # as collected: tests/conftest.py fixes it for each test
needs_onednn = pytest.mark.skipif(not onednn_usable(), reason="this build or CPU does not run oneDNN's products")
TINY = dict(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2, max_len=32)


def seq2seq_batch(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    src, tgt = torch.randint(4, cfg.vocab_size, (3, 7)), torch.randint(4, cfg.vocab_size, (3, 6))
    src[0, 5:] = cfg.pad_id
    labels = tgt.clone()
    labels[1, 4:] = -100
    return {"src": src, "tgt_in": tgt, "labels": labels}


def operators(fn) -> set[str]:
    """Names of the operators `fn()` runs (PyTorch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_forward_and_backward_match_f_linear(bias):
    x = torch.randn(3, 5, 8, requires_grad=True)  # (B, L, in)
    weight = torch.randn(6, 8, requires_grad=True)  # (out, in)
    b = torch.randn(6, requires_grad=True) if bias else None
    inputs = (x, weight) + ((b,) if bias else ())
    expected = F.linear(x, weight, b)
    expected_grads = torch.autograd.grad(expected.pow(2).sum(), inputs)
    y = onednn_linear(x, weight, b)
    grads = torch.autograd.grad(y.pow(2).sum(), inputs)
    assert "OneDnn" in type(y.grad_fn.next_functions[0][0]).__name__
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_other_dtypes_and_autocast_keep_f_linear():
    x, weight = torch.randn(4, 8, dtype=torch.float64, requires_grad=True), torch.randn(6, 8, dtype=torch.float64)
    assert type(onednn_linear(x, weight).grad_fn).__name__ == "MmBackward0"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = onednn_linear(torch.randn(4, 8, requires_grad=True), torch.randn(6, 8))
    assert y.dtype == torch.bfloat16


def test_select_takes_what_this_machine_measured_and_plain_turns_everything_off():
    measured = calibrate.choices()
    backend = select("cpu", "inference", "fp32")
    assert backend.device.type == "cpu" and backend.fused_qkv == measured.fused_qkv_inference
    assert {(rows, kind): k for rows, kind, k in backend.kernels} == {
        (rows, kind): k for rows, by_kind in measured.inference.items() for kind, k in by_kind.items()}
    assert backend.prepack == backend.onednn == any(k != "dense" for _, _, k in backend.kernels)
    assert "cpu inference fp32" in backend.describe()
    train = select("cpu", "train")
    assert not train.prepack  # training keeps live weights
    assert train.onednn == (measured.train_onednn and onednn_usable()) and train.fused_qkv == measured.fused_qkv_train
    plain = select("cpu", "train", plain=True)
    assert plain.plain and plain.describe() == "cpu train fp32: plain"
    assert select(None).device.type == available_devices()[0]
    with pytest.raises(ValueError, match="int8 runs inference on CPU only"):
        select("cpu", "train", "int8")
    with pytest.raises(ValueError, match="mode must be one of"):
        select("cpu", "serve")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_a_missing_device_is_one_clear_error():
    with pytest.raises(ValueError, match=r"device 'cuda' is not available on this machine \(it has: .*cpu\)"):
        select("cuda")


def test_a_train_copy_shares_the_parameters_and_state_dict_names(measured):
    measured(train_onednn=onednn_usable(), fused_qkv=True)
    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY, dropout=0.0))
    prepared = select("cpu", "train").prepare(model)
    assert prepared is not model and prepared.training
    assert prepared.state_dict().keys() == model.state_dict().keys()
    assert {id(p) for p in prepared.parameters()} == {id(p) for p in model.parameters()}
    assert isinstance(prepared.encoder.layers[0].self_attn, FusedQKVAttention)
    if onednn_usable():
        assert isinstance(prepared.decoder.layers[0].feed_forward.linear1, OneDnnLinear)
    assert type(model.encoder.layers[0].self_attn.q_proj) is torch.nn.Linear  # the model itself is untouched
    batch = seq2seq_batch(model.config)
    with torch.no_grad():
        model.encoder.layers[0].self_attn.v_proj.weight.mul_(2.0)  # in place: the copy sees it at once
        torch.testing.assert_close(forward(prepared, batch, "seq2seq")[0], forward(model.train(), batch, "seq2seq")[0],
                                   atol=1e-5, rtol=0)


def test_the_train_step_equals_the_plain_step_in_loss_and_gradients():
    torch.manual_seed(0)
    cfg = preset("tiny").replace(vocab_size=50, d_model=32, n_heads=4, d_ff=64)
    model = build_model(cfg).train()
    prepared = select("cpu", "train").prepare(model)
    batch = seq2seq_batch(cfg)

    def step(module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks on both paths
        logits, kept = forward(module, batch, "seq2seq")
        loss, _ = label_smoothed_loss(logits, kept, smoothing=0.1)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step(model)
    fast_loss, fast_grads = step(prepared)
    torch.testing.assert_close(fast_loss, loss, rtol=1e-5, atol=0)
    assert fast_grads.keys() == grads.keys()
    scale = max(float(g.abs().max()) for g in grads.values())
    for name, grad in grads.items():  # key biases get ~0 gradients (softmax ignores them): compare to the scale
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


@needs_onednn
def test_an_inference_copy_is_prepacked_once_and_refuses_autograd(measured):
    measured()
    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY)).eval()
    prepared = select("cpu", "inference").prepare(model)
    assert isinstance(prepared.decoder.layers[0].feed_forward.linear2, PackedLinear) and not prepared.training
    src, tgt = torch.randint(4, 50, (2, 6)), torch.randint(4, 50, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(prepared(src, tgt), model(src, tgt), atol=1e-5, rtol=0)
        before = prepared(src, tgt)
        model.decoder.layers[0].feed_forward.linear2.bias.add_(1.0)
        assert torch.equal(prepared(src, tgt), before)  # a snapshot: prepare again after changing weights
        torch.testing.assert_close(select("cpu").prepare(model)(src, tgt), model(src, tgt), atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="prepared for inference .* torch.no_grad"):
        prepared(src, tgt)


@needs_onednn
def test_a_packed_layer_computes_one_row_by_mkl_and_many_by_onednn_equally():
    weight, bias = torch.randn(48, 32), torch.randn(48)
    layer = PackedLinear(weight, bias)
    with torch.no_grad():
        many = torch.randn(3, 5, 32)
        torch.testing.assert_close(layer(many), F.linear(many, weight, bias), atol=1e-5, rtol=0)
        assert layer.columns is None  # the transposed copy is made only for layers that see one row
        for shape in ((1, 1, 32), (1, 32), (32,)):
            one = torch.randn(*shape)
            assert "aten::addmm" in operators(lambda x=one: layer(x))
            torch.testing.assert_close(layer(one), F.linear(one, weight, bias), atol=1e-5, rtol=0)
        assert layer.columns.shape == (32, 48) and layer.columns.is_contiguous()
        torch.testing.assert_close(PackedLinear(weight, None)(one), F.linear(one, weight), atol=1e-5, rtol=0)


@needs_onednn
def test_a_subclass_of_linear_is_swapped_as_a_linear(measured):
    measured(fused_qkv=False)

    class Renamed(torch.nn.Linear):  # the same map under another class
        pass

    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY)).eval()
    ffn = model.encoder.layers[0].feed_forward
    ffn.linear2 = Renamed(ffn.linear2.in_features, ffn.linear2.out_features)
    ffn.linear2.load_state_dict(model.encoder.layers[1].feed_forward.linear2.state_dict())
    prepared = select("cpu", "inference").prepare(model)
    assert isinstance(prepared.encoder.layers[0].feed_forward.linear2, PackedLinear)
    assert type(select("cpu", "train").prepare(model).encoder.layers[0].feed_forward.linear2) is OneDnnLinear
    src, tgt = torch.randint(4, 50, (2, 6)), torch.randint(4, 50, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(prepared(src, tgt), model(src, tgt), atol=1e-5, rtol=0)


@needs_onednn
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_the_ffn_activation_runs_inside_the_first_product(activation, measured):
    measured()
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0}, activation=activation)).eval()
    prepared = select("cpu", "inference").prepare(model)
    ffn = prepared.encoder.layers[0].feed_forward
    assert isinstance(ffn, PackedFeedForward) and ffn.linear1.activation == activation  # it owns the activation
    assert [name for name, _ in ffn.named_children()] == ["linear1", "dropout", "linear2"]  # no stand-in for it
    assert not isinstance(model.encoder.layers[0].feed_forward, PackedFeedForward)  # model untouched
    with torch.no_grad():
        ops = operators(lambda: ffn(torch.randn(2, 3, 32)))
    assert "mkldnn::_linear_pointwise" in ops and not ops & {"aten::gelu", "aten::relu", "aten::relu_"}
    ids = torch.randint(4, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(prepared(ids), model(ids), atol=1e-5, rtol=0)
        one = torch.randn(1, 1, 32)  # one row: MKL's product, then the activation
        torch.testing.assert_close(ffn(one), model.encoder.layers[0].feed_forward(one), atol=1e-5, rtol=0)
    assert isinstance(select("cpu", "train").prepare(model).encoder.layers[0].feed_forward.activation,
                      type(model.encoder.layers[0].feed_forward.activation))  # training keeps it as written


def test_one_query_over_many_rows_is_written_out_and_equal(measured):
    # A decoding step at batch 32 x beam 4: one query per row; the backend skips SDPA's flash kernel there.
    measured(fused_qkv=True)
    torch.manual_seed(0)
    plain = MultiHeadAttention(32, 4).eval()
    fused = select("cpu", "inference").prepare(plain)
    query, memory = torch.randn(32, 1, 32), torch.randn(32, 50, 32)  # 32 rows x 4 heads = 128; 50 keys x d_k 8 = 400
    mask = torch.ones(32, 1, 1, 50, dtype=torch.bool)
    mask[3, ..., 5:] = False
    mask[7] = False  # a fully padded source: finite, zero output
    with torch.no_grad():
        for m in (None, mask):
            expected, _ = plain(query, memory, mask=m)
            actual, _ = fused(query, memory, mask=m)
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
        ops = operators(lambda: fused(query, memory))
        assert not any("flash" in name for name in ops)
        assert any("flash" in name for name in operators(lambda: fused(query[:2], memory[:2])))  # few rows: SDPA
        assert any("flash" in name for name in operators(lambda: fused(query[:31], memory[:31])))  # 124 rows x heads
        assert any("flash" in name for name in operators(lambda: fused(query, memory[:, :49])))  # 49 keys x d_k 8: 392
        assert any("flash" in name for name in operators(lambda: fused(torch.randn(32, 4, 32), memory)))  # 4 queries


@pytest.mark.parametrize("padded", [False, True])
def test_the_inference_encoder_never_holds_an_l_by_l_matrix(padded):
    # Long sequences: the fused path (scaled_dot_product_attention's blocked CPU kernel) must not fall
    # back to a kernel that materialises the scores, with or without a padding mask.
    length = 1024
    encoder = build_encoder(ModelConfig(**{**TINY, "n_decoder_layers": 0}, dropout=0.0)).eval()
    prepared = select("cpu", "inference").prepare(encoder)
    x = torch.randn(1, length, TINY["d_model"])
    mask = None
    if padded:
        mask = torch.ones(1, 1, 1, length, dtype=torch.bool)
        mask[..., -7:] = False
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        prepared(x, mask)
    largest = max(event.cpu_memory_usage for event in prof.events())
    one_head_scores = length * length * 4  # float32 bytes of one head's L x L matrix
    assert 0 < largest < one_head_scores / 4
    assert any("flash_attention" in event.name for event in prof.events())


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_lower_precisions_stay_close(precision):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0})).eval()
    ids = torch.randint(4, 50, (2, 9))
    prepared = select("cpu", "inference", precision).prepare(model)
    with torch.no_grad():
        expected, actual = model(ids), prepared(ids).float()
    cosine = F.cosine_similarity(actual.flatten(1), expected.flatten(1))
    assert cosine.min() > 0.98 and not torch.equal(actual, expected)


@pytest.mark.skipif(not (bf16_supported(torch.device("cpu")) and onednn_usable()),
                    reason="this CPU computes no bf16 natively")
def test_bf16_inference_on_a_cpu_with_native_bf16_runs_every_product_on_prepacked_bf16_weights():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY)).eval()
    prepared = select("cpu", "inference", "bf16").prepare(model)
    layers = [m for m in prepared.modules() if isinstance(m, PackedLinear)]
    unused = stacked_away(prepared)  # the projections fused Q/K/V replaced, kept but never called
    assert layers and not any(type(m) is torch.nn.Linear and id(m) not in unused for m in prepared.modules())
    for layer in layers:  # bf16 weights at every row class: half float32's bytes to stream
        assert set(layer.kernels.values()) <= {"packed", "aten"} and layer.kernels["many"] == "packed"
        assert layer.packed.dtype == torch.bfloat16 and layer.columns is None
        assert (layer.weight is not None) == ("aten" in layer.kernels.values())
        assert layer.weight is None or layer.weight.dtype == torch.bfloat16
    src, tgt = torch.randint(4, 50, (2, 7)), torch.randint(4, 50, (2, 5))
    with torch.no_grad():
        expected, actual = model(src, tgt), prepared(src, tgt).float()
    assert F.cosine_similarity(actual.flatten(1), expected.flatten(1)).min() > 0.99
    config = GenerationConfig(max_new_tokens=6, min_len=6)
    with torch.no_grad():
        output = generate(prepared, src, bos_id=1, eos_id=2, config=config)
    assert len(output.tokens) == 2 and all(len(row) >= 6 for row in output.tokens)


@needs_onednn
def test_generate_runs_the_model_as_given_the_plain_path_when_asked(measured):
    measured()
    # generate() used to switch oneDNN on inside a caller's `onednn_linear(False)`: now it runs what it is given.
    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY, dropout=0.0)).eval()
    src = torch.randint(4, 50, (3, 6))
    config = GenerationConfig(max_new_tokens=6, num_beams=2)
    outputs = {}

    def run(module, name):
        outputs[name] = generate(module, src, bos_id=1, eos_id=2, config=config)

    plain_ops = operators(lambda: run(model, "plain"))
    fast_ops = operators(lambda: run(select("cpu", "inference").prepare(model), "fast"))
    assert not any("mkldnn" in name for name in plain_ops) and "aten::linear" in plain_ops
    assert "mkldnn::_linear_pointwise" in fast_ops
    assert outputs["plain"].tokens == outputs["fast"].tokens
    torch.testing.assert_close(outputs["plain"].scores, outputs["fast"].scores, atol=1e-4, rtol=0)


@needs_onednn
@pytest.mark.parametrize("kernel", ["packed", "columns", "dense", "aten"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_every_measured_kernel_computes_f_linear(kernel, activation):
    weight, bias = torch.randn(48, 32), torch.randn(48)
    layer = PackedLinear(weight, bias, activation=activation, kernels={"one": kernel, "few": kernel, "many": kernel})
    act = {None: lambda y: y, "relu": F.relu, "gelu": F.gelu}[activation]
    with torch.no_grad():
        for shape in ((32,), (1, 1, 32), (4, 32), (3, 5, 32), (40, 32)):
            x = torch.randn(*shape)
            torch.testing.assert_close(layer(x), act(F.linear(x, weight, bias)), atol=1e-5, rtol=0)
    assert (layer.packed is None) == (kernel not in ("packed", "aten"))  # "aten" runs it beside other threads
    assert torch.backends.mkldnn.enabled  # "aten" turns oneDNN off for its call only


def test_threads_leaving_the_aten_kernel_in_any_order_leave_onednn_as_they_found_it():
    from aiayn.backends.cpu import _onednn_off

    _onednn_off.__enter__()  # one thread enters
    _onednn_off.__enter__()  # a second enters while the first is inside
    _onednn_off.__exit__(None, None, None)  # the first leaves
    assert not torch.backends.mkldnn.enabled  # the second is still inside
    _onednn_off.__exit__(None, None, None)
    assert torch.backends.mkldnn.enabled


def test_the_aten_kernel_turns_onednn_off_for_its_call_only_even_a_failed_one(monkeypatch):
    from aiayn.backends import cpu

    monkeypatch.setattr(cpu.threading, "active_count", lambda: 1)  # the process's only thread
    layer = PackedLinear(torch.randn(6, 4).bfloat16(), None, kernels=dict.fromkeys(("one", "few", "many"), "aten"))
    seen, linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda *args: seen.append(torch.backends.mkldnn.enabled) or linear(*args))
    with torch.no_grad():
        layer(torch.randn(1, 4).bfloat16())
        assert seen == [False] and torch.backends.mkldnn.enabled
        with pytest.raises(RuntimeError):
            layer(torch.randn(1, 5).bfloat16())  # the wrong width
    assert torch.backends.mkldnn.enabled


@pytest.mark.skipif(not (bf16_supported(torch.device("cpu")) and onednn_usable()),
                    reason="this CPU computes no bf16 natively: it packs no bf16 weight")
def test_the_aten_kernel_leaves_onednn_on_while_another_thread_runs(monkeypatch):
    # The switch is process-wide: flipped under another thread's bf16 attention (batches side by side), PyTorch's
    # kernel read it twice in one call and raised on a CPU with AMX. There the layer runs its packed form instead.

    weight = torch.randn(6, 4).bfloat16()
    layer = PackedLinear(weight, None, kernels=dict.fromkeys(("one", "few", "many"), "aten"))
    assert layer.packed is not None and layer.weight is not None
    x = torch.randn(3, 4).bfloat16()
    with torch.no_grad():
        expected = F.linear(x, weight)
    seen, linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda *args: seen.append(torch.backends.mkldnn.enabled) or linear(*args))
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        with torch.no_grad():
            out = layer(x)
    finally:
        done.set()
        other.join()
    assert seen == [] and torch.backends.mkldnn.enabled  # oneDNN's product over the packed form: the switch untouched
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.02)


def test_a_layer_holds_only_the_weight_forms_its_kernels_use():
    weight = torch.randn(8, 4)
    dense = PackedLinear(weight, None, kernels={"one": "dense", "few": "dense", "many": "dense"})
    assert dense.packed is None and dense.columns is None and dense.weight.data_ptr() == weight.data_ptr()
    with pytest.raises(ValueError, match="kernels must map one, few, many"):
        PackedLinear(weight, None, kernels={"one": "fast"})


@needs_onednn
def test_the_vocabularys_many_rows_are_timed_at_a_decoding_batchs(monkeypatch):
    from aiayn.backends import shapes

    assert shapes.rows_measured("many", "vocabulary") == shapes.VOCABULARY_MANY_ROWS == 64  # batch x beams
    assert [shapes.rows_measured(name, "wide") for name, _ in shapes.ROW_CLASSES] == [1, 4, 256]
    assert [shapes.rows_measured(name, "vocabulary") for name, _ in shapes.ROW_CLASSES] == [1, 4, 64]
    seen, real = set(), F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: (seen.add((x.shape[0], w.shape[0])), real(x, w, b))[1])
    weights = {"wide": (torch.randn(64, 16), torch.randn(64)), "vocabulary": (torch.randn(128, 16), torch.randn(128))}
    with torch.no_grad():  # as calibration times them
        calibrate._inference_kernels(weights, 0, {}, {}, torch.Generator().manual_seed(0))
    assert {(256, 64), (64, 128)} <= seen and (256, 128) not in seen


def test_each_layer_runs_the_kernels_measured_for_its_shape_kind(monkeypatch):
    from aiayn.backends import cpu

    forced = dataclasses.replace(calibrate.choices(), inference={
        "one": {"wide": "columns", "square": "dense", "narrow": "packed", "vocabulary": "dense"},
        "few": dict.fromkeys(("wide", "square", "narrow", "vocabulary"), "packed"),
        "many": {"wide": "dense", "square": "dense", "narrow": "dense", "vocabulary": "packed"}},
        fused_qkv_inference=False)
    monkeypatch.setattr(calibrate, "choices", lambda refresh=False: forced)
    backend = select("cpu", "inference", "fp32")
    assert ("one wide columns/square dense/narrow packed/vocabulary dense, few packed, "
            "many wide dense/square dense/narrow dense/vocabulary packed") in backend.describe()
    model = build_model(ModelConfig(vocab_size=100, d_model=16, d_ff=64, n_heads=2, n_encoder_layers=1,
                                    n_decoder_layers=1, dropout=0.0)).eval()
    prepared = backend.prepare(model)
    ffn = prepared.encoder.layers[0].feed_forward
    assert isinstance(ffn.linear1, cpu.PackedLinear) and ffn.linear1.kernels["one"] == "columns"  # 16 -> 64
    assert ffn.linear2.kernels["one"] == "packed"  # 64 -> 16
    assert prepared.encoder.layers[0].self_attn.q_proj.kernels["one"] == "dense"  # 16 -> 16
    head = prepared.head.proj.kernels  # 16 -> 100: a vocabulary projection, its own shape kind
    assert head["one"] == "dense" and head["many"] == "packed"
    src = torch.randint(4, 100, (1, 5))
    with torch.no_grad():
        ours = generate(prepared, src, bos_id=1, eos_id=2, config=GenerationConfig(max_new_tokens=6, min_len=6))
        plain = generate(model, src, bos_id=1, eos_id=2, config=GenerationConfig(max_new_tokens=6, min_len=6))
    assert ours.tokens == plain.tokens
    assert shape_kind(512, 2048) == "wide" and shape_kind(2048, 512) == "narrow"
    assert shape_kind(512, 512) == "square" and shape_kind(512, 1536) == "wide"  # stacked Q/K/V
    assert shape_kind(512, 37000) == "vocabulary" and shape_kind(768, 30522) == "vocabulary"


def test_other_work_counts_other_programs_not_this_one():
    """A program spinning on a core counts as a core of other work; this process's own threads do not, nor do
    commands that ran a moment ago (which the load average would count for a minute)."""
    import subprocess
    import sys
    import time

    quiet = timing.other_work(0.5)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert timing.other_work(0.5) > quiet + 0.5
    finally:
        spinner.kill()
        spinner.wait()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    own = threading.Thread(target=spin)
    own.start()
    try:
        assert timing.other_work(0.5) < quiet + 0.5
    finally:
        stop.set()
        own.join()


def test_choices_measured_on_a_busy_machine_are_measured_again_once_it_is_quieter(tmp_path, monkeypatch, other_work):
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 1)
    other_work(64.0)  # far more work than cores
    busy = calibrate._load_or_measure(refresh=False)
    assert busy.load == 64.0
    assert calibrate._load_or_measure(refresh=False) == busy  # as busy now: kept
    other_work(0.5)
    quiet = calibrate._load_or_measure(refresh=False)  # quieter now: measured again, and cached as quiet
    assert quiet.load == 0.5
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("measured again"))
    other_work(0.0)
    assert calibrate._load_or_measure(refresh=False) == quiet
    monkeypatch.setattr(timing, "usable_cores", lambda: 2)
    assert not timing.measured_busy(1.0, 0.0, threads=1)  # a core was free for it: stays until --recalibrate
    assert timing.measured_busy(1.99, 1.3, threads=2)  # two threads beside another job: measured again
    assert not timing.measured_busy(0.3, 0.0, threads=2)


def test_a_models_widths_measured_on_a_busy_machine_mark_the_whole_cache_busy(tmp_path, monkeypatch, other_work):
    """A measurement added to a cache measured quietly carries its own competition into it, and a quiet measurement
    after it does not hide it: a busy file is measured again once the machine is quieter."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 1)
    monkeypatch.setattr(calibrate, "_chosen", {})
    other_work(0.0)
    calibrate.inference_kernels(32, 64, 200, 1 << 20)
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process reads the quiet file, then measures beside work
    other_work(64.0)
    calibrate.training_choices(64, 32, 128)
    assert calibrate._measured_so_far().load == 64.0
    other_work(0.0)
    monkeypatch.setattr(calibrate, "measure", lambda description=None: calibrate.Choices(
        inference=calibrate.by_shape(dict.fromkeys(("one", "few", "many"), "dense")), train_onednn=False,
        fused_qkv_inference=True, fused_qkv_train=False, torch_layers_inference=False, machine=description))
    full = calibrate.choices()  # a base model's shapes, measured quietly
    assert full.inference is not None and full.training and full.load == 64.0
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process on a quiet machine: the file is no cache
    assert calibrate._cached(calibrate.machine()) is None


def test_a_cache_file_of_the_wrong_types_is_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    path = calibrate.cache_path(calibrate.machine())
    path.parent.mkdir(parents=True, exist_ok=True)
    for edited in ({"seconds": None}, {"inference_layers": {"32x64x200": [True]}}):
        path.write_text(json.dumps({"machine": calibrate.machine(), **edited}))
        assert calibrate._cached(calibrate.machine()) is None


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "over the size bound"])
def test_a_cache_path_that_is_no_regular_file_is_no_cache_and_never_blocks(tmp_path, monkeypatch, kind):
    """A FIFO nobody writes would block a plain read for ever, /dev/zero would fill the memory: both, and a file
    past `CACHE_LIMIT`, are passed over at once (measured again), and the next write replaces them."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    path = calibrate.cache_path(calibrate.machine())
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:  # sparse: no disk used
            f.truncate(calibrate.CACHE_LIMIT + 1)
    found = []
    reader = threading.Thread(target=lambda: found.append(calibrate._cached(calibrate.machine())), daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive() and kind == "fifo":
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # let the blocked reader go before failing
    assert not reader.is_alive() and found == [None], f"reading a cache that is a {kind} blocked"



def _store_many(process: int, times: int) -> None:
    """Store `times` measurements of this process's own, one at a time (as a process measuring one shape after another
    does), each a new key of `Choices.training`."""
    for step in range(times):
        calibrate._store(calibrate.Choices(machine=calibrate.machine(), training={f"{process}-{step}": [True, False]}))


def test_processes_measuring_into_one_cache_keep_each_others_measurements(tmp_path, monkeypatch):
    """Three processes calibrating at once: each store merges, under a lock, with what the others wrote (the last
    writer took all before); a refresh replaces the file, and a file measured busier is replaced, not merged."""
    import multiprocessing

    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_store_many, args=(n, 15)) for n in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    found = calibrate._on_disk(calibrate.machine())
    assert set(found.training) == {f"{n}-{step}" for n in range(3) for step in range(15)}
    fresh = calibrate.Choices(machine=calibrate.machine(), training={"new": [False, False]})
    calibrate._store(fresh, merge=False)
    assert calibrate._on_disk(calibrate.machine()).training == {"new": [False, False]}
    calibrate._store(dataclasses.replace(fresh, load=3.0))
    calibrate._store(calibrate.Choices(machine=calibrate.machine(), training={"quiet": [True, True]}, load=0.5))
    assert calibrate._on_disk(calibrate.machine()).training == {"quiet": [True, True]}

def test_the_measurements_are_cached_per_machine_and_measured_again_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    first = calibrate._load_or_measure(refresh=False)
    files = list(tmp_path.glob("cpu-products-*.json"))
    assert len(files) == 1 and set(first.inference) == {"one", "few", "many"}
    kinds = ("wide", "square", "narrow", "vocabulary")
    products = {f"{rows} {kind}" for rows in ("one", "few", "many") for kind in kinds}
    assert {k.split(": ")[0] for k in first.seconds} == products | {
        "qkv one", "qkv", "train", "qkv train", "encoder layer"}
    assert first.int8_weights is None  # measured when int8 inference first asks, not before
    assert all(kernel in ("packed", "columns", "dense") for by_kind in first.inference.values()
               for kernel in by_kind.values())
    assert "inference products: one row" in first.describe()
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("measured again"))
    assert calibrate._load_or_measure(refresh=False) == first  # read back, not measured
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # another kind of machine: another key
    assert calibrate.cache_path(calibrate.machine()) != files[0]


def test_int8_weights_are_measured_when_int8_first_asks_and_then_cached(tmp_path, monkeypatch, quiet_cores):
    from aiayn.backends import int8

    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "_chosen", {})
    assert calibrate.choices().int8_weights is None
    measured = calibrate.int8_weight_choices()
    if int8.int8_weights_usable():
        assert set(measured) == {"one", "few"} and "int8 weights one square: float32" in calibrate.choices().seconds
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process: read from the cache file
    monkeypatch.setattr(calibrate, "_int8_weights", lambda *args: pytest.fail("measured again"))
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("measured again"))
    assert calibrate.int8_weight_choices() == measured


def test_training_products_are_chosen_at_the_widths_of_the_model_trained(tmp_path, monkeypatch, quiet_cores):
    """Each shape a run asks for is measured once, cached, and what `select` gives that run; a base model's shapes
    are not measured for it."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "_chosen", {})
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("a base model's shapes measured"))
    narrow = calibrate.training_choices(64, 32, 128)
    assert calibrate._measured_so_far().training == {"64x32x128": list(narrow)}
    assert "train 64x32x128: dense" in calibrate._measured_so_far().seconds
    assert "training 64x32x128 (rows x d_model x d_ff)" in calibrate._measured_so_far().describe()
    backend = select("cpu", "train", train_shape=(64, 32, 128))
    assert (backend.onednn, backend.fused_qkv) == (narrow[0] and onednn_usable(), narrow[1])
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process: read from the cache file
    monkeypatch.setattr(calibrate, "_training", lambda *args, **kwargs: pytest.fail("measured again"))
    assert calibrate.training_choices(64, 32, 128) == narrow
    monkeypatch.setattr(calibrate, "_training", lambda *args, **kwargs: (True, False))
    calibrate.training_choices(calibrate.TRAIN_SHAPE_ROWS * 2, 32, 128)  # a larger batch is timed at the cap
    assert f"{calibrate.TRAIN_SHAPE_ROWS}x32x128" in calibrate._measured_so_far().training


def test_bf16_training_times_attention_in_both_precisions_at_its_width_once(tmp_path, monkeypatch, quiet_cores):
    """A bf16 training run asks whether attention runs faster in float32 at its width: timed once, cached, read back
    in a new process, printed with its margin; the backend carries the answer into the prepared copy only."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "_chosen", {})
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("a base model's shapes measured"))
    up = calibrate.bf16_training_attention(256, 64)
    so_far = calibrate._measured_so_far()
    assert so_far.bf16_attention == {"256x64": up}
    assert {"bf16 attention 256x64: bf16", "bf16 attention 256x64: float32"} <= set(so_far.seconds)
    assert "bf16 attention 256x64: float32" in so_far.ratios
    assert "bf16 training at 256x64 (rows x d_model): attention in " in so_far.describe()
    backend = select("cpu", "train", "bf16", train_shape=(256, 64, 128))
    assert backend.float32_attention == up and backend.fused_qkv
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process: read from the cache file
    monkeypatch.setattr(calibrate, "_bf16_attention", lambda *args, **kwargs: pytest.fail("measured again"))
    assert calibrate.bf16_training_attention(256, 64) == up
    monkeypatch.setattr(calibrate, "_bf16_attention", lambda *args, **kwargs: True)
    assert calibrate.bf16_training_attention(calibrate.TRAIN_SHAPE_ROWS * 2, 64)  # a larger batch: timed at the cap
    assert f"{calibrate.TRAIN_SHAPE_ROWS}x64" in calibrate._measured_so_far().bf16_attention


def test_training_on_a_cpu_with_native_bf16_takes_bf16_where_a_step_measured_faster(tmp_path, monkeypatch, quiet_cores):
    """Left to the machine, a CPU run trains in bf16 only where native and where a step at its widths ran faster so:
    timed once (both precisions as `select` prepares them), cached, read back in a new process, printed with its
    margin; an explicit precision is never measured, a CPU without native bf16 never asks."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "_chosen", {})
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("a base model's shapes measured"))
    monkeypatch.setattr(backend_module, "native_bf16_cpu", lambda device: True)
    monkeypatch.setattr(calibrate, "bf16_training_faster", BF16_TRAINING_FASTER)
    backend = select("cpu", "train", train_shape=(256, 32, 64))
    so_far = calibrate._measured_so_far()
    faster = so_far.bf16_training["256x32x64"]
    assert backend.precision == ("bf16" if faster else "fp32")
    assert {"bf16 training 256x32x64: float32", "bf16 training 256x32x64: bf16"} <= set(so_far.seconds)
    assert "bf16 training 256x32x64: bf16" in so_far.ratios
    assert "training at 256x32x64 (rows x d_model x d_ff): " in so_far.describe()
    assert "256x32" in so_far.bf16_attention  # the bf16 copy it timed was prepared as a bf16 run's
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process: read from the cache file
    monkeypatch.setattr(calibrate, "_training_steps", lambda *args, **kwargs: pytest.fail("measured again"))
    assert select("cpu", "train", train_shape=(256, 32, 64)).precision == backend.precision
    assert select("cpu", "train", "fp32", train_shape=(128, 32, 64)).precision == "fp32"  # asked for: not timed
    for faster in (True, False):
        monkeypatch.setattr(calibrate, "bf16_training_faster", lambda *args, faster=faster: faster)
        assert select("cpu", "train", train_shape=(256, 32, 64)).precision == ("bf16" if faster else "fp32")
    monkeypatch.setattr(backend_module, "native_bf16_cpu", lambda device: False)
    monkeypatch.setattr(calibrate, "bf16_training_faster", lambda *args: pytest.fail("timed without native bf16"))
    assert select("cpu", "train", train_shape=(256, 32, 64)).precision == "fp32"
    assert backend_module.default_precision(torch.device("cpu"), "inference") == "fp32"


@pytest.mark.parametrize("chosen", [True, False])
def test_bf16_training_runs_attention_in_the_precision_measured_and_learns_the_same(chosen, monkeypatch):
    """Where float32 attention was measured faster, the prepared copy's attention receives float32 inputs under
    autocast (its projections stay bf16) and returns bf16; the user's model is untouched; loss and gradients stay
    within bf16's rounding of the bf16 path's."""
    monkeypatch.setattr(calibrate, "bf16_training_attention", lambda rows, d_model: chosen)
    torch.manual_seed(0)
    cfg = preset("tiny").replace(vocab_size=50, d_model=32, n_heads=4, d_ff=64, dropout=0.0)
    model = build_model(cfg).train()
    backend = select("cpu", "train", "bf16", train_shape=(64, 32, 64))
    assert backend.float32_attention == chosen
    assert ("attention in float32" in backend.describe()) == chosen and not backend.plain
    prepared = backend.prepare(model)
    flags = [m.float32_attention for m in prepared.modules() if isinstance(m, MultiHeadAttention)]
    assert len(flags) == 6 and set(flags) == {chosen}
    assert not any(m.float32_attention for m in model.modules() if isinstance(m, MultiHeadAttention))
    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **k: seen.append(q.dtype) or sdpa(q, *a, **k))
    batch = seq2seq_batch(cfg)

    def step(module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with backend.autocast():
            logits, kept = forward(module, batch, "seq2seq")
        loss, _ = label_smoothed_loss(logits.float(), kept, smoothing=0.1)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step(prepared)
    assert set(seen) == {torch.float32 if chosen else torch.bfloat16} and len(seen) == len(flags)
    plain_loss, plain_grads = step(select("cpu", "train", "bf16", plain=True).prepare(model))
    torch.testing.assert_close(loss, plain_loss, rtol=2e-2, atol=0)
    scale = max(float(g.abs().max()) for g in plain_grads.values())
    for name, grad in plain_grads.items():  # bf16 keeps 8 bits of mantissa: within a few of its steps
        torch.testing.assert_close(grads[name], grad, rtol=0.1, atol=0.05 * scale, msg=name)


def test_inference_products_are_chosen_at_the_widths_of_the_model_run(tmp_path, monkeypatch, quiet_cores):
    """A model narrower than a base one runs the kernels, Q/K/V and encoder layers measured at its own shapes,
    measured once and cached, without waiting for a base model's shapes; a base model's widths keep the machine's."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "_chosen", {})
    base_measure = calibrate.measure
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("a base model's shapes measured"))
    model = build_model(ModelConfig(vocab_size=200, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1,
                                    n_decoder_layers=1, dropout=0.0, max_len=32))
    shape = inference_shape(model)
    assert shape[:3] == (32, 64, 200) and shape[3] == 4 * sum(p.numel() for p in model.parameters())
    backend = select("cpu", "inference", inference_shape=shape)
    so_far = calibrate._measured_so_far()
    narrow, (fused, torch_layers) = so_far.inference_widths["32x64x200"], so_far.inference_layers["32x64x200"]
    assert so_far.inference is None and set(so_far.inference_widths) == set(so_far.inference_layers) == {"32x64x200"}
    assert (backend.kernels, backend.fused_qkv) == (cpu.kernel_triples(narrow), fused)
    assert set(narrow) == {"one", "few", "many"} and all(set(k) == {"wide", "square", "narrow", "vocabulary"}
                                                         for k in narrow.values())
    assert {"few square 32x64x200: dense", "qkv one 32x64x200: fused", "encoder layer 32x64x200: torch"} <= set(
        so_far.seconds)
    described = so_far.describe()
    assert "a base model's shapes: not measured" in described
    assert "inference at 32x64x200 (d_model x d_ff x vocabulary)" in described
    assert "at 32x64x200: fused QKV" in described
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process: read from the cache file
    for what in ("_inference_kernels", "_fused_qkv_inference", "_torch_layers_inference"):
        monkeypatch.setattr(calibrate, what, lambda *args, **kwargs: pytest.fail("measured again"))
    assert calibrate.inference_kernels(*shape) == narrow and calibrate.inference_layers(*shape) == (fused, torch_layers)
    # a base model's shapes, measured when first asked for, join what the model's widths measured
    monkeypatch.setattr(calibrate, "measure", base_measure)
    monkeypatch.setattr(calibrate, "_chosen", {})
    monkeypatch.setattr(calibrate, "_inference_kernels", lambda weights, *args, **kwargs: calibrate.by_shape(
        dict.fromkeys(("one", "few", "many"), "dense")))
    monkeypatch.setattr(calibrate, "_fused_qkv_inference", lambda *args, **kwargs: True)
    monkeypatch.setattr(calibrate, "_torch_layers_inference", lambda *args, **kwargs: False)
    full = calibrate.choices()
    assert full.inference is not None and full.inference_widths == {"32x64x200": narrow}
    assert full.inference_layers == {"32x64x200": [fused, torch_layers]} and "qkv one 32x64x200: fused" in full.seconds
    assert calibrate.inference_kernels(512, 2048, 37000, 1 << 28) == full.inference
    assert calibrate.inference_layers(512, 2048, 37000, 1 << 28) == (True, False)


def _small_model_shape_on_an_empty_cache(tmp_path, monkeypatch) -> tuple[int, int, int, int]:
    """The `inference_shape` of a 32-wide model, its machine's cache empty (in `tmp_path`) and quick to fill: what is
    measured for its widths alone, a base model's shapes never."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "_chosen", {})
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("a base model's shapes measured"))
    return inference_shape(build_model(ModelConfig(vocab_size=200, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1,
                                                   n_decoder_layers=1, dropout=0.0, max_len=32)))


@pytest.mark.skipif(not (bf16_supported(torch.device("cpu")) and onednn_usable()),
                    reason="this CPU computes no bf16 natively")
def test_bf16_kernels_are_measured_at_the_widths_of_the_model_run_and_cached(tmp_path, monkeypatch, quiet_cores):
    shape = _small_model_shape_on_an_empty_cache(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu.threading, "active_count", lambda: 1)  # the process's only thread
    backend = select("cpu", "inference", "bf16", inference_shape=shape)
    so_far = calibrate._measured_so_far()
    found = so_far.bf16_widths["32x64x200"]
    assert backend.kernels == cpu.kernel_triples(found) and backend.prepack
    assert all(kernel in ("packed", "aten") for by_kind in found.values() for kernel in by_kind.values())
    assert set(found["many"].values()) == {"packed"}  # not timed: oneDNN's bf16 arithmetic
    assert {"bf16 one square 32x64x200: aten", "bf16 few vocabulary 32x64x200: packed"} <= set(so_far.seconds)
    assert "bf16 at 32x64x200: one row: wide " in so_far.describe()
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process: read from the cache file
    monkeypatch.setattr(calibrate, "_bf16_kernels", lambda *args, **kwargs: pytest.fail("measured again"))
    assert calibrate.bf16_kernels(*shape) == found


@pytest.mark.skipif(not (bf16_supported(torch.device("cpu")) and onednn_usable()),
                    reason="this CPU computes no bf16 natively")
def test_bf16_kernels_keep_onednn_where_another_thread_is_alive(tmp_path, monkeypatch):
    # The "aten" kernel turns PyTorch's process-wide oneDNN switch off for its calls: timed beside another thread's
    # bf16 attention, it made that raise on a CPU with AMX. Not timed there: oneDNN's packed product is kept.
    shape = _small_model_shape_on_an_empty_cache(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu.threading, "active_count", lambda: 2)
    monkeypatch.setattr(cpu, "aten_linear", lambda *args, **kwargs: pytest.fail("the switch turned off"))
    found = calibrate.bf16_kernels(*shape)
    assert all(kernel == "packed" for by_kind in found.values() for kernel in by_kind.values())
    assert torch.backends.mkldnn.enabled


@pytest.mark.skipif(not (bf16_supported(torch.device("cpu")) and onednn_usable()),
                    reason="bf16 is compared with float32 only where it is native")
def test_a_steps_products_are_timed_in_bf16_against_float32_at_the_model_widths_and_cached(tmp_path, monkeypatch,
                                                                                          quiet_cores):
    shape = _small_model_shape_on_an_empty_cache(tmp_path, monkeypatch)
    faster = calibrate.bf16_faster(*shape)
    assert set(faster) == {"one", "few", "many"} and all(isinstance(f, bool) for f in faster.values())
    so_far = calibrate._measured_so_far()
    assert so_far.bf16_faster_widths == {"32x64x200": faster}
    assert {f"bf16 step {rows} 32x64x200: {p}" for rows in faster for p in ("float32", "bf16")} <= set(so_far.seconds)
    assert "bf16 step one 32x64x200: bf16" in so_far.ratios  # the margin `aiayn verify` prints
    assert "a step's products in bf16 at 32x64x200: one row " in so_far.describe()
    # each precision on its own kernels, measured at the same widths on the way
    assert "32x64x200" in so_far.bf16_widths and "32x64x200" in so_far.inference_widths
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process: read from the cache file
    monkeypatch.setattr(calibrate, "_bf16_step", lambda *args, **kwargs: pytest.fail("measured again"))
    assert calibrate.bf16_faster(*shape) == faster


def test_on_two_threads_each_precision_counts_its_faster_thread_count_at_one_and_few_rows(monkeypatch):
    """A step of few rows runs on one thread where that is faster (`aiayn.inference.threads`): bf16 against float32
    there counts each precision on its faster count, repeat by repeat, and many rows on all threads."""
    gen = torch.Generator().manual_seed(0)
    weights = calibrate._width_weights(gen, 16, 32, 0)
    kernels = calibrate.by_shape({"one": "dense", "few": "dense", "many": "dense"})
    offered = []

    def bf16_wins_on_one_thread_only(candidates, repeats=timing.REPEATS, *, warm=False):
        offered.append(sorted(candidates))
        for run in candidates.values():
            run()  # each sets its count, and gives the process's back
        fast = {"float32 on 2": 1.0, "float32 on 1": 1.0, "bf16 on 2": 3.0, "bf16 on 1": 0.5}
        return {name: [fast.get(name, 1.0)] * 4 for name in candidates}
    monkeypatch.setattr(timing, "timed", bf16_wins_on_one_thread_only)
    process = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.no_grad():
            faster = calibrate._bf16_step(weights, kernels, kernels, 1 << 16, {}, {}, gen, "")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(process)
    both = ["bf16 on 1", "bf16 on 2", "float32 on 1", "float32 on 2"]
    assert offered == [both, both, ["bf16 on 2", "float32 on 2"]]
    assert faster == {"one": True, "few": True, "many": False}


def test_a_model_without_a_vocabulary_projection_does_not_time_one(tmp_path, monkeypatch):
    """An encoder giving hidden states (an embedder) or labels never runs a vocabulary product: none is timed for
    it; a masked-LM head, an encoder-decoder and a decoder-only model have one."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "_chosen", {})
    encoder = ModelConfig(vocab_size=200, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1, n_decoder_layers=0,
                          dropout=0.0, max_len=32)
    assert inference_shape(build_model(encoder))[2] == 0
    assert inference_shape(build_model(encoder.replace(head="masked_lm")))[2] == 200
    assert inference_shape(build_model(encoder.replace(causal=True)))[2] == 200
    backend = select("cpu", "inference", inference_shape=inference_shape(build_model(encoder)))
    narrow = calibrate._measured_so_far().inference_widths["32x64x0"]
    assert all(set(by_kind) == {"wide", "square", "narrow"} for by_kind in narrow.values())
    assert backend.kernels == cpu.kernel_triples(narrow)
    assert not any("vocabulary" in what for what in calibrate._measured_so_far().seconds)


def test_a_plain_kernel_is_kept_unless_another_is_clearly_faster():
    assert timing.pick({"dense": [1.0] * 3, "packed": [0.97] * 3}, "dense") == "dense"  # within MARGIN
    assert timing.pick({"dense": [1.0] * 3, "packed": [0.5] * 3, "columns": [0.7] * 3}, "dense") == "packed"
    # one repeat that a candidate had the machine to itself does not decide
    assert timing.pick({"dense": [1.0, 1.0, 1.0], "packed": [0.3, 1.0, 1.02]}, "dense") == "dense"
    # ratios within a repeat: load that drifts between repeats hits both alike
    assert timing.pick({"dense": [1.0, 3.0, 2.0], "packed": [0.8, 2.4, 1.6]}, "dense") == "packed"
    assert row_class(1) == "one" and row_class(4) == "few" and row_class(17) == "many"
    # a median win smaller than its spread is no win: faster by the margin in only half of the repeats
    noisy = {"dense": [1.0] * 8, "packed": [0.6, 0.6, 0.6, 0.6, 1.0, 1.0, 1.1, 1.1]}
    assert timing.pick(noisy, "dense") == "dense"
    noisy["packed"][4:6] = [0.7, 0.7]  # now in six of eight
    assert timing.pick(noisy, "dense") == "packed"
    assert timing.speedups(noisy, "packed", "dense")[1] > 1 / (1 - timing.MARGIN)


def test_a_warm_timing_runs_each_candidate_untimed_right_before_its_timed_call(monkeypatch):
    """`warm`: each timed pass finds what its own last pass left in the cache, as a step finds the step before's."""
    calls, clock = [], iter(range(1000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    times = timing.timed({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2, warm=True)
    assert calls == ["a", "a", "b", "b", "b", "b", "a", "a"]  # each one twice in turn, the first untimed
    assert {name: len(t) for name, t in times.items()} == {"a": 2, "b": 2}
    calls.clear()
    timing.timed({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2)
    assert calls == ["a", "b", "a", "b", "b", "a"]


def test_few_row_products_are_timed_warm_over_the_models_bytes_and_many_rows_as_they_come(monkeypatch):
    """One- and few-row products cycle through copies holding the model's bytes, each pass right after its own
    (`calibrate._cold_copies`) where those may fit in a cache; many rows run one weight, timed as they come, and
    copies of `COLD_BYTES` stream from memory whatever ran before."""
    seen = []
    real = timing.timed

    def recording(candidates, repeats=timing.REPEATS, *, warm=False):
        seen.append(warm)
        return real(candidates, 2, warm=warm)
    monkeypatch.setattr(timing, "timed", recording)
    gen = torch.Generator().manual_seed(0)
    weights = calibrate._width_weights(gen, 16, 32, 0)
    with torch.no_grad():
        calibrate._inference_kernels(weights, 1 << 16, {}, {}, gen)
        assert seen == [True] * 3 + [True] * 3 + [False] * 3  # one, few, many rows x three shape kinds
        seen.clear()
        monkeypatch.setattr(calibrate, "COLD_BYTES", 1 << 16)
        calibrate._inference_kernels({"square": weights["square"]}, 1 << 16, {}, {}, gen)
    assert seen == [False] * 3


def test_choices_cached_before_the_backend_code_changed_are_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    first = calibrate._load_or_measure(refresh=False)
    assert "in 3 of 4 repeats" in first.describe() or all(
        kernel == "dense" for by_kind in first.inference.values() for kernel in by_kind.values())
    measured = []
    monkeypatch.setattr(calibrate, "measure", lambda description=None: measured.append(1) or first)
    assert calibrate._load_or_measure(refresh=False) == first and not measured  # newer than the code: read back
    newer_code = calibrate.cache_path(calibrate.machine()).stat().st_mtime + 60
    monkeypatch.setattr(calibrate, "_library_time", lambda: newer_code)
    calibrate._load_or_measure(refresh=False)
    assert measured == [1]


def test_an_unwritable_cache_only_costs_a_measurement(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(blocker / "aiayn"))
    monkeypatch.setattr(timing, "REPEATS", 1)
    inference = calibrate._load_or_measure(refresh=False).inference
    assert set(inference) == {"one", "few", "many"}
    assert all(set(by_kind) == {"wide", "square", "narrow", "vocabulary"} for by_kind in inference.values())
    assert blocker.read_text() == "not a directory"


def test_the_default_precision_is_bf16_on_a_gpu_that_has_it_and_for_training_only_on_wide_models(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(backend_module, "bf16_supported", lambda device: True)
    assert backend_module.default_precision(cuda, "inference") == "bf16"
    assert backend_module.default_precision(cuda, "train") == "bf16"  # no shape given: a base model's
    assert backend_module.default_precision(cuda, "train", (4096, 512, 2048)) == "bf16"
    assert backend_module.default_precision(cuda, "train", (4096, 256, 1024)) == "fp32"  # launch-bound: casts cost
    assert backend_module.default_precision(torch.device("cpu"), "inference") == "fp32"
    monkeypatch.setattr(backend_module, "bf16_supported", lambda device: False)
    assert backend_module.default_precision(cuda, "inference") == "fp32"


@pytest.mark.parametrize("kind", ["link", "folder"])
def test_a_lock_path_taken_by_something_else_costs_only_the_lock(tmp_path, monkeypatch, kind):
    """A link or a folder planted where the cache's lock file goes: the measurements are still cached, unlocked."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    path = calibrate.cache_path(calibrate.machine())
    lock = path.with_name(path.name + ".lock")
    lock.symlink_to(tmp_path / "elsewhere") if kind == "link" else lock.mkdir()
    calibrate._store(calibrate.Choices(machine=calibrate.machine(), training={"x": [True, False]}))
    assert calibrate._on_disk(calibrate.machine()).training == {"x": [True, False]}
    assert not (tmp_path / "elsewhere").exists()
