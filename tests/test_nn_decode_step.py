"""`decode_step`, the decoder's one-position step written with fewer calls, equals `decode` to the last bit."""

import pytest
import torch

from aiayn.backends import select
from aiayn.config import ModelConfig
from aiayn.inference import generation
from aiayn.inference.generation import GenerationConfig, generate
from aiayn.nn.attention import attention_weights
from aiayn.nn.model import build_model


def tiny(norm_first: bool, activation: str = "relu"):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                      max_len=64, dropout=0.0, norm_first=norm_first, activation=activation)
    return build_model(cfg).eval()


def prepared(model, how: str):
    return model if how == "plain" else select("cpu", "inference", how).prepare(model)


def source() -> torch.Tensor:
    src = torch.randint(4, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    src[1, 6:] = 0  # padded: cross-attention takes the source mask
    return src


@pytest.mark.parametrize("how", ["plain", "fp32", "int8"])
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
@torch.no_grad()
def test_decode_step_equals_decode_on_the_same_cache(how, norm_first, activation):
    model = prepared(tiny(norm_first, activation), how)
    src = source()
    mask = model.source_mask(src)
    memory = model.encode(src, mask)
    tokens = torch.randint(4, 50, (3, 6), generator=torch.Generator().manual_seed(2))
    by_decode, by_step = model.new_cache(), model.new_cache()
    first = model.decode(tokens[:, :1], memory, memory_mask=mask, cache=by_decode)
    assert torch.equal(model.decode(tokens[:, :1], memory, memory_mask=mask, cache=by_step), first)
    for t in range(1, tokens.shape[1]):
        expected = model.decode(tokens[:, t : t + 1], memory, memory_mask=mask, cache=by_decode)  # (B, 1, d_model)
        got = model.decode_step(tokens[:, t : t + 1], memory_mask=mask, cache=by_step)
        assert torch.equal(got, expected), f"step {t}"
    for a, b in zip(by_decode.self_attn, by_step.self_attn):
        assert torch.equal(a.key, b.key) and torch.equal(a.value, b.value)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("how", ["plain", "fp32"])
@torch.no_grad()
def test_generate_with_direct_steps_equals_the_module_path(monkeypatch, how, beam):
    model = prepared(tiny(False), how)
    config = GenerationConfig(max_new_tokens=10, beam_size=beam, no_repeat_ngram_size=2 if beam > 1 else 0)
    direct = generate(model, source(), bos_id=1, eos_id=2, config=config)
    monkeypatch.setattr(generation, "_direct_steps", lambda model, cross: False)
    modules = generate(model, source(), bos_id=1, eos_id=2, config=config)
    assert direct.tokens == modules.tokens
    assert torch.equal(direct.scores, modules.scores)


@torch.no_grad()
def test_hooks_on_the_decoder_keep_every_step_on_the_modules():
    model = tiny(False)
    with attention_weights([layer.cross_attn for layer in model.decoder.layers]) as cross:
        assert not generation._direct_steps(model, None)  # the hooks would miss the direct steps
        generate(model, source(), bos_id=1, eos_id=2, config=GenerationConfig(max_new_tokens=5))
        assert all(w is not None and w.shape[2] == 1 for w in cross)  # the last step's weights (B, h, 1, S)
    assert generation._direct_steps(model, None)
