"""The NumPy reference (aiayn/reference.py) equals the PyTorch model, option by option (atol 1e-5),
on the plain modules and on the CPU backend's prepared copy (`run_on`)."""

import numpy as np
import pytest
import torch

from aiayn import reference
from aiayn.config import ModelConfig
from aiayn.nn.model import build_model

ATOL = 1e-5
TINY = dict(vocab_size=40, d_model=16, n_heads=4, d_ff=24, n_encoder_layers=2, n_decoder_layers=2, max_len=32)

OPTIONS = {
    "paper": {},
    "pre-LN-gelu": dict(norm_first=True, activation="gelu"),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "split-positions": dict(pe_layout="split"),
    "learned-positions": dict(positional="learned"),
    "no-positions": dict(positional="none"),
    "no-bias-unscaled": dict(bias=False, scale_embeddings=False),
    "untied-two-vocabularies": dict(tgt_vocab_size=30, share_embeddings=False, tie_embeddings=False),
}


def batch(vocab: int, tgt_vocab: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(1, vocab, (3, 7))
    src[1, 4:] = pad_id  # right padding
    src[2, 1:] = pad_id  # a single real token
    tgt = torch.randint(1, tgt_vocab, (3, 5))
    return src, tgt


def randomise_norms(model: torch.nn.Module) -> None:
    """LayerNorm gains and biases away from (1, 0), so that a mixed-up norm shows."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.normal_(1.0, 0.2)
                m.bias.normal_(0.0, 0.2)


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@torch.no_grad()
def test_encoder_decoder_logits_equal_reference(options, run_on):
    cfg = ModelConfig(**TINY, **options)
    model = build_model(cfg)
    randomise_norms(model)
    model.eval()
    src, tgt = batch(cfg.vocab_size, cfg.target_vocab_size)
    weights = reference.export_weights(model)
    expected = reference.forward(weights, cfg, src.numpy(), tgt.numpy())
    assert expected.dtype == np.float64
    actual = run_on(model)(src, tgt)
    torch.testing.assert_close(actual, torch.from_numpy(expected).float(), atol=ATOL, rtol=0)


@torch.no_grad()
def test_encode_and_decode_equal_reference_separately(run_on):
    cfg = ModelConfig(**TINY)
    plain = build_model(cfg).eval()
    model = run_on(plain)
    src, tgt = batch(cfg.vocab_size, cfg.vocab_size)
    w = reference.export_weights(plain)
    memory = reference.encode(w, cfg, src.numpy())
    torch.testing.assert_close(model.encode(src), torch.from_numpy(memory).float(), atol=ATOL, rtol=0)
    states = reference.decode(w, cfg, tgt.numpy(), memory, reference.padding_mask(src.numpy(), cfg.pad_id))
    actual = model.decode(tgt, model.encode(src), memory_mask=model.source_mask(src))
    torch.testing.assert_close(actual, torch.from_numpy(states).float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("options", [
    dict(positional="learned", activation="gelu", type_vocab_size=2, embedding_norm=True, scale_embeddings=False),
    dict(norm_first=True),
], ids=["bert-like", "pre-LN"])
@torch.no_grad()
def test_encoder_only_hidden_states_equal_reference(options, run_on):
    cfg = ModelConfig(**{**TINY, "n_decoder_layers": 0}, **options)
    model = build_model(cfg)
    randomise_norms(model)
    model.eval()
    ids = torch.randint(1, cfg.vocab_size, (2, 6))
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    token_types = None
    if cfg.type_vocab_size:
        token_types = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    expected = reference.encoder_hidden_states(
        reference.export_weights(model), cfg, ids.numpy(), attention_mask.numpy(),
        None if token_types is None else token_types.numpy())
    actual = run_on(model)(ids, attention_mask=attention_mask, token_type_ids=token_types)
    torch.testing.assert_close(actual, torch.from_numpy(expected).float(), atol=ATOL, rtol=0)


def test_reference_building_blocks_match_their_formulas():
    x = np.random.default_rng(0).normal(size=(2, 3, 8))
    normed = reference.layer_norm(x, np.ones(8), np.zeros(8))
    np.testing.assert_allclose(normed.mean(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(normed.std(-1), 1.0, atol=1e-4)  # eps 1e-5 in the denominator
    np.testing.assert_allclose(reference.softmax(x).sum(-1), 1.0)
    pe = reference.sinusoidal(5, 8)
    np.testing.assert_allclose(pe[3, 2], np.sin(3 / 10000 ** (2 / 8)))
    np.testing.assert_allclose(pe[3, 3], np.cos(3 / 10000 ** (2 / 8)))
    np.testing.assert_allclose(reference.sinusoidal(5, 8, "split")[:, :4], pe[:, 0::2])
    assert reference.causal_mask(3)[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    gelu = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(reference.activation(x, "gelu"), gelu, atol=1e-12)


def test_reference_gives_zero_attention_to_a_query_without_keys():
    q = k = v = np.ones((1, 1, 2, 4))
    mask = np.array([True, False])[None, None, :, None] & np.ones((1, 1, 1, 2), dtype=bool)  # row 2: no key
    out = reference.attention(q, k, v, mask)
    np.testing.assert_allclose(out[0, 0, 0], 1.0)
    np.testing.assert_allclose(out[0, 0, 1], 0.0)
