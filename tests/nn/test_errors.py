"""Bad input raises a ValueError that names the problem; empty batches give empty results."""

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.nn.attention import MultiHeadAttention
from aiayn.nn.model import build_model

TINY = dict(vocab_size=40, d_model=16, n_heads=4, d_ff=32, n_encoder_layers=2, n_decoder_layers=2, max_len=12)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def encoder_only():
    return build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0, "positional": "learned",
                                      "head": "sequence_classification", "num_labels": 3})).eval()


def ids(*shape: int, high: int = 40) -> torch.Tensor:
    return torch.randint(1, high, shape)


@pytest.mark.parametrize(("src", "message"), [
    (ids(5), r"token ids must have shape \(batch, length\), got \(5,\)"),
    (ids(2, 3, 4), r"token ids must have shape \(batch, length\), got \(2, 3, 4\)"),
    (torch.rand(2, 3), "token ids must be an int64 or int32 tensor, got torch.float32"),
    (torch.tensor([[3, -1, 4]]), "token id -1 is negative"),
    (torch.tensor([[3, 40, 4]]), r"token id 40 is outside the vocabulary \(size 40\)"),
])
def test_bad_source_ids(model, src, message):
    with pytest.raises(ValueError, match=message):
        model.encode(src)
    with pytest.raises(ValueError, match=message):
        model(src, ids(1, 3))


def test_bad_target_ids(model):
    memory = model.encode(ids(2, 4))
    with pytest.raises(ValueError, match=r"token id 41 is outside the vocabulary \(size 40\)"):
        model.decode(torch.tensor([[1, 41], [1, 2]]), memory)
    with pytest.raises(ValueError, match=r"target ids must have shape \(batch, length\)"):
        model.decode(ids(4), memory)
    with pytest.raises(ValueError, match=r"memory of shape \(3, 4, 16\) does not fit a target batch of 2"):
        model.decode(ids(2, 3), torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match="with d_model 16"):
        model.decode(ids(2, 3), torch.randn(2, 4, 8))


def test_sequence_longer_than_learned_positions(encoder_only):
    with pytest.raises(ValueError, match="sequence of 13 tokens is longer than the 12 positions this model learned"):
        encoder_only(ids(1, 13))
    assert encoder_only(ids(1, 12)).shape == (1, 3)


def test_learned_positions_limit_counts_cached_positions():
    model = build_model(ModelConfig(**{**TINY, "positional": "learned"})).eval()
    src = ids(1, 4)
    memory, cache = model.encode(src), model.new_cache()
    model.decode(ids(1, 12), memory, cache=cache)
    with pytest.raises(ValueError, match="sequence of 13 tokens is longer than the 12 positions"):
        model.decode(ids(1, 1), memory, cache=cache)


@pytest.mark.parametrize(("mask", "message"), [
    (torch.ones(2, 5), "attention mask must be a bool tensor .True = may attend., got torch.float32"),
    (torch.ones(2, 5, dtype=torch.long), "attention mask must be a bool tensor"),
    (torch.ones(2, 1, 1, 4, dtype=torch.bool), r"attention mask of shape \(2, 1, 1, 4\) does not fit"),
    (torch.ones(3, 1, 1, 5, dtype=torch.bool), r"does not fit \(batch 2, queries 5, keys 5\)"),
    (torch.ones(1, 2, 3, 4, 5, dtype=torch.bool), "attention mask must have 2 to 4 dimensions"),
])
def test_bad_source_masks(model, mask, message):
    with pytest.raises(ValueError, match=message):
        model.encode(ids(2, 5), mask)


def test_bad_memory_and_target_masks(model):
    src, tgt = ids(2, 5), ids(2, 3)
    memory = model.encode(src)
    with pytest.raises(ValueError, match=r"does not fit \(batch 2, queries 3, keys 5\)"):
        model.decode(tgt, memory, memory_mask=torch.ones(2, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be a bool tensor"):
        model.decode(tgt, memory, memory_mask=torch.ones(2, 1, 1, 5))
    with pytest.raises(ValueError, match=r"does not fit \(batch 2, queries 3, keys 3\)"):
        model.decode(tgt, memory, tgt_mask=torch.ones(2, 1, 1, 4, dtype=torch.bool))
    # A (B, S) key-padding mask in our convention is accepted and broadcast.
    keep = torch.tensor([[True] * 5, [True, True, False, False, False]])
    torch.testing.assert_close(model.decode(tgt, memory, memory_mask=keep),
                               model.decode(tgt, memory, memory_mask=keep[:, None, None, :]))


def test_bad_attention_mask_for_encoder_only(encoder_only):
    with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 4\) must match the ids' shape \(2, 5\)"):
        encoder_only(ids(2, 5), attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must hold only 0/1 integers or bools"):
        encoder_only(ids(2, 5), attention_mask=torch.full((2, 5), 0.5))
    with pytest.raises(ValueError, match="attention_mask must hold only 0/1"):
        encoder_only(ids(2, 5), attention_mask=torch.full((2, 5), 2))


def test_attention_rejects_inputs_of_the_wrong_shape():
    attn = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"attention query must have shape \(batch, length, 16\), got \(5, 16\)"):
        attn(torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"got \(2, 5, 8\)"):
        attn(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"attention key_value must have shape \(2, length, 16\), got \(3, 4, 16\)"):
        attn(torch.randn(2, 5, 16), torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match=r"d_model \(16\) must be divisible by n_heads \(3\)"):
        MultiHeadAttention(16, 3)


def test_empty_batch_gives_empty_results(model, encoder_only):
    empty_src, empty_tgt = torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long)
    assert model.encode(empty_src).shape == (0, 5, 16)
    assert model(empty_src, empty_tgt).shape == (0, 3, 40)
    assert encoder_only(torch.zeros(0, 5, dtype=torch.long)).shape == (0, 3)
    hidden_model = build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0})).eval()
    assert hidden_model(torch.zeros(0, 5, dtype=torch.long)).shape == (0, 5, 16)


def test_empty_sequences_give_empty_or_finite_results(model):
    assert model.encode(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, 16)
    assert model(ids(2, 4), torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, 40)
    out = model(torch.zeros(2, 0, dtype=torch.long), ids(2, 3))  # nothing to attend to in the source
    assert out.shape == (2, 3, 40) and torch.isfinite(out).all()
    mean_pool = build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0, "head": "sequence_classification",
                                           "num_labels": 3, "pooling": "mean"})).eval()
    assert torch.isfinite(mean_pool(torch.zeros(2, 0, dtype=torch.long))).all()
    first_pool = build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0, "head": "sequence_classification",
                                            "num_labels": 3})).eval()
    with pytest.raises(ValueError, match="cannot pool the first token of empty sequences"):
        first_pool(torch.zeros(2, 0, dtype=torch.long))
