"""Training dropout with its masks drawn as random integers: `F.dropout`'s distribution and arithmetic, seeded;
swapped into a CPU training copy where measured faster, nowhere else."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends import calibrate, select, timing
from aiayn.backends.dropout import BitsDropout, bits_dropout, draws_bits, use_bits_dropout
from aiayn.config import preset
from aiayn.nn.attention import MultiHeadAttention, attend
from aiayn.nn.model import build_model
from aiayn.training.objectives import forward


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_an_element_is_dropped_with_probability_p(p):
    """Over a million elements the dropped share is p within 5 standard deviations, and the mean is kept."""
    n = 1 << 20
    out = bits_dropout(torch.ones(n), p)
    dropped = float((out == 0).float().mean())
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert abs(float(out.mean()) - 1.0) < 5 * math.sqrt(p / (1 - p) / n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_kept_element_is_scaled_as_f_dropout_scales_it_and_its_gradient_too(dtype):
    """Kept: x / (1 - p) to the last bit of F.dropout's own result (the scale rounded to the input's type, then one
    product); dropped: 0. The gradient is the same mask; the output keeps the input's type."""
    p = 0.1
    x = (torch.randn(4096, 64) * 3).to(dtype).requires_grad_()
    ours, theirs = bits_dropout(x, p), F.dropout(x, p, training=True)
    assert ours.dtype == dtype
    both = (ours != 0) & (theirs != 0)
    assert both.sum() > 0.7 * x.numel()
    assert torch.equal(ours[both], theirs[both])
    grad = torch.randn_like(ours)
    ours.backward(grad)
    scale = torch.tensor(1 / (1 - p), dtype=dtype)
    assert torch.equal(x.grad, torch.where(ours != 0, grad * scale, torch.zeros((), dtype=dtype)))


def test_masks_follow_the_seed():
    x = torch.ones(10_000)
    torch.manual_seed(3)
    first = bits_dropout(x, 0.3)
    torch.manual_seed(3)
    assert torch.equal(bits_dropout(x, 0.3), first)
    assert not torch.equal(bits_dropout(x, 0.3), first)  # the generator moved on


def test_the_module_is_nn_dropout_outside_cpu_training_at_p_strictly_between_0_and_1():
    """Evaluation and p = 0 return the input; p = 1 gives zeros; in place writes the input; a CPU training call at
    0 < p < 1 draws by `bits_dropout` (same seed, same mask)."""
    x = torch.randn(64, 8)
    module = BitsDropout(0.2).eval()
    assert module(x) is x
    assert BitsDropout(0.0).train()(x) is x
    assert torch.equal(BitsDropout(1.0).train()(x), torch.zeros_like(x))
    torch.manual_seed(5)
    expected = bits_dropout(x, 0.2)
    torch.manual_seed(5)
    assert torch.equal(BitsDropout(0.2).train()(x), expected)
    y = x.clone()
    torch.manual_seed(5)
    assert BitsDropout(0.2, inplace=True).train()(y) is y
    assert torch.equal(y, expected)


def test_every_dropout_of_a_copy_is_swapped_with_its_p():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Sequential(nn.Dropout(0.1, inplace=True), nn.ReLU()))
    assert use_bits_dropout(model) is model
    swapped = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert [type(m) for m in swapped] == [BitsDropout, BitsDropout]
    assert [(m.p, m.inplace) for m in swapped] == [(0.3, False), (0.1, True)]


def test_a_copys_attention_drops_its_weights_by_random_integers_too():
    """`use_bits_dropout` gives every attention `bits_dropout` for its weights; `draws_bits` says so only where some
    dropout's p is above 0."""
    attention = MultiHeadAttention(16, 4, dropout=0.1)
    assert attention.weights_dropout is None
    assert use_bits_dropout(attention) is attention and attention.weights_dropout is bits_dropout
    assert draws_bits(attention)
    assert not draws_bits(use_bits_dropout(MultiHeadAttention(16, 4, dropout=0.0)))
    assert not draws_bits(nn.Sequential(MultiHeadAttention(16, 4, dropout=0.1), nn.Dropout(0.1)))  # not swapped


@pytest.mark.parametrize("masked", [False, True])
def test_attention_written_out_with_a_dropout_function_is_the_equation(masked):
    """With `drop` and p above 0 the equation is written out: no weights returned unless asked; with a function that
    drops nothing it equals SDPA without dropout, a query with no key included; with `bits_dropout` it is the
    softmax's weights under the same seeded mask, times V, and its gradient flows."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, requires_grad=True) for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
        mask[0, :, :, 3:] = False
        mask[1, :, 2] = False  # a query with no key: its output is 0
    expected, _ = attend(q, k, v, mask)
    out, weights = attend(q, k, v, mask, dropout_p=0.1, drop=lambda w, p: w)
    assert weights is None
    torch.testing.assert_close(out, expected)
    full, weights = attend(q, k, v, mask, need_weights=True)
    torch.manual_seed(7)
    dropped, _ = attend(q, k, v, mask, dropout_p=0.25, drop=bits_dropout)
    torch.manual_seed(7)
    torch.testing.assert_close(dropped, bits_dropout(weights, 0.25) @ v)
    assert not torch.allclose(dropped, full)
    dropped.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("masked", [False, True])
def test_attention_written_out_with_f_dropout_is_sdpas_dropout_to_rounding(masked):
    """Under the same seed, the equation written out with `F.dropout` as its `drop` draws SDPA's own mask (SDPA's
    math path on a CPU), a query with no key included: the written-out form is the same computation."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
        mask[0, :, :, 4:] = False
        mask[1, :, 3] = False
    torch.manual_seed(11)
    ours, _ = attend(q, k, v, mask, dropout_p=0.3, drop=lambda w, p: F.dropout(w, p))
    torch.manual_seed(11)
    theirs, _ = attend(q, k, v, mask, dropout_p=0.3)  # SDPA with dropout_p
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_under_bf16_autocast_the_weights_are_dropped_in_float32():
    """The softmax and the mask in float32 (the scale 1 / (1 - p) in bf16 would shrink every row), the output in
    V's type."""
    seen = []
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.bfloat16) for _ in range(3))
    with torch.autocast("cpu", torch.bfloat16):
        out, _ = attend(q, k, v, None, dropout_p=0.1, drop=lambda w, p: seen.append(w.dtype) or bits_dropout(w, p))
    assert seen == [torch.float32] and out.dtype == torch.bfloat16


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_training_attention_uses_its_weights_dropout_on_a_cpu_only_in_training(is_causal):
    """A layer with `weights_dropout` calls it in training (the causal path too) with its p, in place of SDPA's
    dropout; in evaluation, or at p 0 or 1, it is not called and the layer computes as before."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(16, 4, dropout=0.3)
    x = torch.randn(2, 6, 16)
    expected = attention.eval()(x, is_causal=is_causal)[0]
    calls = []
    attention.weights_dropout = lambda w, p: calls.append((tuple(w.shape), p)) or w
    torch.testing.assert_close(attention.train()(x, is_causal=is_causal)[0], expected)
    assert calls == [((2, 4, 6, 6), 0.3)]
    attention.eval()(x, is_causal=is_causal)
    attention.dropout = 0.0
    attention.train()(x, is_causal=is_causal)
    attention.dropout = 1.0  # SDPA's: every weight dropped
    assert torch.equal(attention.train()(x, is_causal=is_causal)[0], attention.out_proj.bias.expand(2, 6, 16))
    assert len(calls) == 1


def test_attention_written_out_for_its_dropout_keeps_its_products_in_bf16():
    """`float32_attention` casts attention up where SDPA runs it; where `weights_dropout` writes the equation out
    in training, the products stay in bf16 (measured the faster); in evaluation SDPA runs, cast up again."""
    attention = MultiHeadAttention(16, 4, dropout=0.1).train()
    attention.float32_attention = True
    seen = []
    equation = attention._equation
    attention._equation = lambda q, *rest: seen.append(q.dtype) or equation(q, *rest)
    x = torch.randn(2, 6, 16)
    with torch.autocast("cpu", torch.bfloat16):
        attention(x)
        attention.weights_dropout = bits_dropout
        attention(x)
        attention.eval()(x)
    assert seen == [torch.float32, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("chosen", [True, False])
def test_a_cpu_training_copy_draws_dropout_as_measured_and_the_model_is_untouched(chosen, monkeypatch):
    """The backend carries the choice into training copies (fp32 and bf16), never into inference ones; the user's
    model keeps its modules; one seeded training step runs the same twice."""
    monkeypatch.setattr(calibrate, "bits_dropout_faster", lambda: chosen)
    cfg = preset("tiny").replace(vocab_size=50, d_model=32, n_heads=4, d_ff=64, dropout=0.2)
    model = build_model(cfg).train()
    for precision in ("fp32", "bf16"):
        backend = select("cpu", "train", precision, train_shape=(64, 32, 64))
        assert backend.bits_dropout == chosen
        assert ("dropout masks from random bits" in backend.describe()) == chosen
        copy = backend.prepare(model)
        kinds = {type(m) for m in copy.modules() if isinstance(m, nn.Dropout)}
        assert kinds == ({BitsDropout} if chosen else {nn.Dropout})
        attentions = [m for m in copy.modules() if isinstance(m, MultiHeadAttention)]
        assert attentions and {m.weights_dropout for m in attentions} == {bits_dropout if chosen else None}
        assert draws_bits(copy) == chosen
    assert {type(m) for m in model.modules() if isinstance(m, nn.Dropout)} == {nn.Dropout}
    assert all(m.weights_dropout is None for m in model.modules() if isinstance(m, MultiHeadAttention))
    assert not select("cpu", "inference", "fp32").bits_dropout
    prepared = select("cpu", "train", "fp32", train_shape=(64, 32, 64)).prepare(model)
    src, tgt = torch.randint(4, 50, (2, 6)), torch.randint(4, 50, (2, 7))
    batch = {"src": src, "tgt_in": tgt[:, :-1], "labels": tgt[:, 1:]}
    torch.manual_seed(1)
    first, _ = forward(prepared, batch, "seq2seq")
    torch.manual_seed(1)
    again, _ = forward(prepared, batch, "seq2seq")
    assert torch.equal(first, again)


def test_the_choice_is_timed_once_kept_and_printed_with_its_margin(tmp_path, monkeypatch, quiet_cores):
    """Timed against `F.dropout` forward and backward the first time a CPU training run asks, cached, read back in a
    new process, printed by `aiayn verify`'s description with its margin."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "_chosen", {})
    monkeypatch.setattr(calibrate, "measure", lambda description=None: pytest.fail("a base model's shapes measured"))
    monkeypatch.delenv("AIAYN_DROPOUT")  # tests/conftest.py keeps F.dropout's masks for the rest
    faster = calibrate.bits_dropout_faster()
    so_far = calibrate._measured_so_far()
    assert so_far.bits_dropout is faster
    assert {"dropout: bernoulli", "dropout: bits"} <= set(so_far.seconds) and "dropout: bits" in so_far.ratios
    assert f"training dropout: {'random bits' if faster else 'bernoulli'} (" in so_far.describe()
    assert select("cpu", "train", "fp32", train_shape=(64, 32, 64)).bits_dropout is faster
    monkeypatch.setattr(calibrate, "_chosen", {})  # a new process: read from the cache file
    monkeypatch.setattr(calibrate, "_dropouts", lambda *args, **kwargs: pytest.fail("measured again"))
    assert calibrate.bits_dropout_faster() is faster


def test_the_environment_decides_without_measuring(monkeypatch):
    monkeypatch.setattr(calibrate, "_dropouts", lambda *args, **kwargs: pytest.fail("measured"))
    for value, bits in (("bits", True), ("bernoulli", False)):
        monkeypatch.setenv("AIAYN_DROPOUT", value)
        assert calibrate.bits_dropout_faster() is bits
        assert select("cpu", "train", "fp32", train_shape=(64, 32, 64)).bits_dropout is bits
    monkeypatch.setenv("AIAYN_DROPOUT", "fast")
    with pytest.raises(ValueError, match="AIAYN_DROPOUT must be bits or bernoulli"):
        calibrate.bits_dropout_faster()
