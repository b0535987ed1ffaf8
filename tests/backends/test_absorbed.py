"""Cross-attention absorbed into the memory (aiayn.backends.absorbed): the plain step's results, where it reads less."""

import dataclasses

import pytest
import torch

from aiayn.backends import absorbed, select
from aiayn.backends.absorbed import AbsorbedCrossAttention, absorb, absorb_cross_attention
from aiayn.config import ModelConfig
from aiayn.inference import GenerationConfig, generate
from aiayn.nn.attention import MultiHeadAttention, attention_weights
from aiayn.nn.model import build_model

# d_model 64 over 2 heads: absorbed tensors fit (B h S <= 32) for a batch of 2 sentences of up to 8 tokens
SMALL = dict(vocab_size=40, d_model=64, n_heads=2, d_ff=96, n_encoder_layers=2, n_decoder_layers=2, max_len=40)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _memory_kv(attn: MultiHeadAttention, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory's keys and values (B, h, S, d_k), as a decoder's first step computes them."""
    b, length, _ = memory.shape
    return tuple(t.view(b, length, attn.n_heads, -1).transpose(1, 2) for t in attn.project_kv(memory))


@pytest.mark.parametrize("bias", [True, False])
@torch.no_grad()
def test_an_absorbed_step_equals_the_plain_attention_with_padding_and_an_empty_row(bias):
    attn = MultiHeadAttention(128, 2, bias=bias).eval()
    wrapped = AbsorbedCrossAttention(attn)
    memory = torch.randn(3, 5, 128)
    mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., 3:] = False  # padding
    mask[2] = False  # a row that may attend nowhere: zero attention output, as `attend` makes it
    absorbed = wrapped.absorb(*_memory_kv(attn, memory), mask)
    assert absorbed is not None  # 3 rows x 2 heads x 5 positions <= 128 / 2
    query = torch.randn(3, 1, 128)
    expected = attn(query, memory, mask=mask)[0]
    torch.testing.assert_close(wrapped.attend_absorbed(query, absorbed), expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_memory_too_long_to_absorb_is_not_absorbed():
    attn = MultiHeadAttention(64, 2).eval()
    wrapped = AbsorbedCrossAttention(attn)
    assert wrapped.absorb(*_memory_kv(attn, torch.randn(1, 17, 64)), None) is None  # 1 x 2 x 17 = 34 > 64 / 2
    assert wrapped.absorb(*_memory_kv(attn, torch.randn(1, 16, 64)), None) is not None


@torch.no_grad()
def test_absorbing_follows_weights_changed_in_place():
    """The wrapper keeps no copy of W_Q and W_O: it reads the projections' own storage (a backend's prepacked
    layers are copies, so a prepared model is still prepared again after its weights change)."""
    attn = MultiHeadAttention(64, 2).eval()
    wrapped = AbsorbedCrossAttention(attn)
    attn.q_proj.weight.mul_(2.0)
    attn.out_proj.bias.add_(1.0)
    memory, query = torch.randn(1, 4, 64), torch.randn(1, 1, 64)
    absorbed = wrapped.absorb(*_memory_kv(attn, memory), None)
    torch.testing.assert_close(wrapped.attend_absorbed(query, absorbed), attn(query, memory)[0], rtol=1e-5, atol=1e-5)


def _prepared_pair(cfg: ModelConfig):
    model = build_model(cfg).eval()
    backend = select("cpu", "inference", "fp32")
    assert backend.absorbed_cross and "cross-attention absorbed" in backend.describe()
    return backend.prepare(model), dataclasses.replace(backend, absorbed_cross=False).prepare(model)


@pytest.mark.parametrize(("beam", "batch", "length"), [(1, 2, 7), (3, 1, 5)])
def test_a_prepared_model_decodes_as_without_absorbing(beam, batch, length, monkeypatch):
    """Greedy over a batch whose sentences end at different steps (rows leave the batch), and beam search."""
    absorbed_model, separate = _prepared_pair(ModelConfig(**SMALL))
    assert all(isinstance(layer.cross_attn, AbsorbedCrossAttention) for layer in absorbed_model.decoder.layers)
    calls = []
    monkeypatch.setattr(absorbed, "absorb", lambda *args: calls.append(1) or absorb(*args))  # once per layer and search
    src = torch.randint(4, 40, (batch, length))
    src[-1, length - 2:] = 0  # padded
    config = GenerationConfig(max_new_tokens=12, num_beams=beam)
    with torch.inference_mode():
        ours, theirs = (generate(m, src, bos_id=1, eos_id=2, config=config) for m in (absorbed_model, separate))
    assert calls  # every row x head x position fits: the absorbed step ran
    assert len(calls) == 2  # each of the two layers calls its memory once, however many steps
    assert ours.tokens == theirs.tokens
    torch.testing.assert_close(ours.scores, theirs.scores, rtol=1e-4, atol=1e-4)


def test_attention_weights_still_come_through_the_wrapper():
    absorbed_model, separate = _prepared_pair(ModelConfig(**SMALL))
    src = torch.randint(4, 40, (1, 6))
    with torch.inference_mode():
        config = GenerationConfig(max_new_tokens=5, return_attention=True)
        ours, theirs = (generate(m, src, bos_id=1, eos_id=2, config=config) for m in (absorbed_model, separate))
    for a, b in zip(ours.attention, theirs.attention, strict=True):
        torch.testing.assert_close(a, b)
    with torch.inference_mode(), attention_weights([absorbed_model.decoder.layers[0].cross_attn]) as weights:
        absorbed_model.decode(torch.ones(1, 1, dtype=torch.long), absorbed_model.encode(src), memory_mask=None,
                      cache=absorbed_model.new_cache())
    assert weights[0].shape == (1, 2, 1, 6)


def test_only_decoder_cross_attention_is_wrapped_and_parameters_are_shared():
    model = build_model(ModelConfig(**SMALL)).eval()
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    absorb_cross_attention(model)
    assert all(type(layer.self_attn) is MultiHeadAttention for layer in model.decoder.layers)
    assert {p.data_ptr() for p in model.parameters()} == set(before.values())
    assert model.decoder.layers[0].cross_attn.d_model == 64  # the wrapped module's parts read through
