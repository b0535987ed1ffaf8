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
    config = GenerationConfig(max_new_tokens=10, min_len=10, beam_size=beam,
                              no_repeat_ngram_size=2 if beam > 1 else 0)
    steps = []
    decode_step = type(model).decode_step
    monkeypatch.setattr(type(model), "decode_step", lambda self, *a, **k: steps.append(1) or decode_step(self, *a, **k))
    direct = generate(model, source(), bos_id=1, eos_id=2, config=config)
    assert len(steps) == 9  # every step after the first
    monkeypatch.setattr(generation, "_direct_steps", lambda model, cross: False)
    modules = generate(model, source(), bos_id=1, eos_id=2, config=config)
    assert len(steps) == 9
    assert direct.tokens == modules.tokens
    assert torch.equal(direct.scores, modules.scores)


def test_decode_step_takes_a_filled_cache_and_the_mask_source_mask_returns():
    model = tiny(False)
    src = source()
    mask = model.source_mask(src)
    memory, cache = model.encode(src, mask), model.new_cache()
    with torch.no_grad():
        with pytest.raises(ValueError, match="cache that decode has filled"):
            model.decode_step(torch.ones(3, 1, dtype=torch.long), memory_mask=mask, cache=cache)
        model.decode(torch.ones(3, 1, dtype=torch.long), memory, memory_mask=mask, cache=cache)
        with pytest.raises(ValueError, match=r"\(B, 1, 1, S\).*model.source_mask"):
            model.decode_step(torch.ones(3, 1, dtype=torch.long), memory_mask=mask[:, 0], cache=cache)


@torch.no_grad()
def test_hooks_keep_every_step_on_the_modules():
    model = tiny(False)
    calls = []
    with attention_weights([model.decoder.layers[0].cross_attn], keep=False):  # pre-hooks only
        pre = model.decoder.layers[0].cross_attn.register_forward_pre_hook(lambda *args: calls.append("pre"))
        generate(model, source(), bos_id=1, eos_id=2, config=GenerationConfig(max_new_tokens=5, min_len=5))
        pre.remove()
    assert calls.count("pre") == 5
    handle = model.decoder.layers[1].register_forward_hook(lambda *args: calls.append("layer"))
    every = torch.nn.modules.module.register_module_forward_hook(
        lambda module, *args: calls.append("every") if module is model.decoder.layers[0] else None)
    try:
        generate(model, source(), bos_id=1, eos_id=2, config=GenerationConfig(max_new_tokens=5, min_len=5))
    finally:
        handle.remove()
        every.remove()
    assert calls.count("layer") == 5 and calls.count("every") == 5  # each of the five steps through the modules
    assert generation._direct_steps(model, None)  # hooks gone: direct again
