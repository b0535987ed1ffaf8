"""Property tests over drawn shapes, lengths and masks (hypothesis): padding invariance, no causal leak,
a batch equals its sentences one by one, and the mask boundary accepts exactly what it can read unambiguously.

Example counts are small (the models are tiny and fixed): the file runs in seconds.
"""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiayn.config import ModelConfig
from aiayn.nn.masks import check_mask
from aiayn.nn.model import build_model

ATOL = 1e-5
PAD, VOCAB = 0, 30
FAST = settings(max_examples=12, deadline=None, derandomize=True, database=None)


@functools.cache
def seq2seq(positional: str = "sinusoidal", norm_first: bool = False):
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2,
                                   n_decoder_layers=2, max_len=24, positional=positional,
                                   norm_first=norm_first)).eval()


@functools.cache
def classifier():
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2,
                                   n_decoder_layers=0, max_len=24, positional="learned",
                                   head="sequence_classification", num_labels=3, pooling="mean")).eval()


sentence = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=9)  # real tokens, never <pad>


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


@FAST
@given(sources=st.lists(sentence, min_size=1, max_size=4), targets=st.lists(sentence, min_size=4, max_size=4),
       options=st.sampled_from([("sinusoidal", False), ("learned", True)]))
def test_a_batch_equals_its_sentences_one_by_one(sources, targets, options):
    model = seq2seq(*options)
    targets = targets[: len(sources)]
    with torch.inference_mode():
        batch = model(padded(sources), padded(targets))  # (B, T, V)
        for i, (src, tgt) in enumerate(zip(sources, targets)):
            alone = model(torch.tensor([src]), torch.tensor([tgt]))  # (1, len(tgt), V)
            torch.testing.assert_close(batch[i, : len(tgt)], alone[0], atol=ATOL, rtol=0)


@FAST
@given(texts=st.lists(sentence, min_size=2, max_size=4), extra=st.integers(1, 5))
def test_more_padding_changes_no_prediction(texts, extra):
    model = classifier()
    ids = padded(texts)
    wider = torch.cat([ids, torch.full((ids.shape[0], extra), PAD)], dim=1)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), model(wider), atol=ATOL, rtol=0)
        hidden, hidden_wide = model.encode(ids), model.encode(wider)
    real = ids != PAD
    torch.testing.assert_close(hidden[real], hidden_wide[:, : ids.shape[1]][real], atol=ATOL, rtol=0)


@FAST
@given(src=sentence, tgt=st.lists(st.integers(1, VOCAB - 1), min_size=2, max_size=10), data=st.data())
def test_no_position_sees_the_future(src, tgt, data):
    model = seq2seq()
    t = data.draw(st.integers(0, len(tgt) - 2), label="last position kept")
    changed = tgt[: t + 1] + data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=len(tgt) - t - 1,
                                                max_size=len(tgt) - t - 1), label="new future")
    with torch.inference_mode():
        before = model(torch.tensor([src]), torch.tensor([tgt]))[0, : t + 1]
        after = model(torch.tensor([src]), torch.tensor([changed]))[0, : t + 1]
    torch.testing.assert_close(before, after, atol=ATOL, rtol=0)


@FAST
@given(batch=st.integers(1, 4), q_len=st.integers(1, 5), k_len=st.integers(1, 6),
       layout=st.sampled_from(["key_padding", "query_key", "batch_query_key", "4d"]), seed=st.integers(0, 99))
def test_a_mask_is_read_as_its_shape_says_or_refused(batch, q_len, k_len, layout, seed):
    torch.manual_seed(seed)
    full = torch.rand(batch, 1, q_len, k_len) > 0.3  # the (B, 1, L_q, L_k) mask each layout stands for
    if layout == "key_padding":
        mask, expected = full[:, 0, 0, :], full[:, :, :1, :]
    elif layout == "query_key":
        mask, expected = full[0, 0], full[:1]
    elif layout == "batch_query_key":
        mask, expected = full[:, 0], full
    else:
        mask, expected = full, full
    ambiguous = mask.dim() == 2 and batch == q_len > 1 and mask.shape == (batch, k_len)
    if ambiguous:
        with pytest.raises(ValueError, match="is ambiguous"):
            check_mask(mask, batch, q_len, k_len)
        return
    got = check_mask(mask, batch, q_len, k_len)
    assert torch.equal(got.expand(batch, 1, q_len, k_len), expected.expand(batch, 1, q_len, k_len))


@FAST
@given(texts=st.lists(sentence, min_size=1, max_size=3))
def test_an_explicit_padding_mask_equals_the_pad_id_default(texts):
    model = classifier()
    ids = padded(texts)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, attention_mask=(ids != PAD).long()), model(ids), atol=ATOL, rtol=0)
