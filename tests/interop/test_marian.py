"""aiayn <-> Hugging Face MarianMTModel: equal logits, and equal generate() outputs for greedy and beam search."""

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.inference.generation import GenerationConfig, generate
from aiayn.nn.model import build_model

transformers = pytest.importorskip("transformers")
from aiayn.interop.marian import from_marian, to_marian, to_split_layout  # noqa: E402

PAD, BOS = 0, 1
transformers.logging.set_verbosity_error()


def marian_like(seed: int, vocab: int = 24, **changes) -> torch.nn.Module:
    """A tiny random model configured like Marian, rescaled so that greedy and beam outputs vary.

    At the usual init a random post-LN model repeats one token whatever the source; sharper
    attention (x4), larger embeddings (x3) and a smaller feed-forward (x0.2) make outputs depend on
    the source and the position. LayerNorm gains and biases move away from (1, 0) so they are really mapped.
    """
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                      dropout=0.0, pe_layout="split", max_len=64, **changes)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "feed_forward" in name:
                p.mul_(0.2)
            elif "attn" in name:
                p.mul_(4.0)
            else:
                p.mul_(3.0)  # token embeddings (and an untied output projection)
    return model


def padded(vocab: int = 24, batch: int = 4) -> torch.Tensor:
    src = torch.randint(4, vocab, (batch, 7))
    src[1, 5:] = PAD
    src[2, 3:] = PAD
    return src


@pytest.mark.parametrize("changes", [{}, {"share_embeddings": False, "tgt_vocab_size": 30},
                                     {"tie_embeddings": False, "activation": "gelu"}])
def test_logits_equal_marian_with_padded_sources(changes, run_on):
    model = marian_like(0, **changes)
    hf = to_marian(model)
    src = padded()
    tgt = torch.randint(4, 24, (4, 6))
    tgt[:, 0] = PAD  # Marian's decoder starts from <pad>
    with torch.no_grad():
        plain, ours = model(src, tgt), run_on(model)(src, tgt)
        theirs = hf(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=tgt).logits
    torch.testing.assert_close(plain, theirs, atol=1e-4, rtol=0)
    # A backend's kernels round differently (PyTorch's fused encoder layer, where this machine chose it, scales Q
    # before its product), and this model's sharpened attention (x4) amplifies float32 rounding about a
    # hundredfold by the logits; the backend's equality to the plain path is tested in test_backends*.
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)
    back = from_marian(hf)
    with torch.no_grad():
        torch.testing.assert_close(back(src, tgt), plain, atol=1e-6, rtol=0)
    assert back.config == model.config.replace(dropout=back.config.dropout)


@pytest.mark.parametrize("changes", [{}, {"share_embeddings": False, "tgt_vocab_size": 30},
                                     {"tie_embeddings": False}, {"norm_first": True}])
def test_split_layout_is_the_same_function(changes):
    """A permutation of the d_model basis turns the interleaved sinusoids into split ones: outputs stay equal."""
    model = marian_like(0, **changes).to(torch.float64)
    model = build_model(model.config.replace(pe_layout="interleaved")).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    split = to_split_layout(model).to(torch.float64)
    assert split.config.pe_layout == "split" and split.config.replace(pe_layout="interleaved") == model.config
    src, tgt = padded(), torch.randint(4, 24, (4, 6))
    with torch.no_grad():
        torch.testing.assert_close(split(src, tgt), model(src, tgt), atol=1e-10, rtol=0)
    ours = split.state_dict()
    changed = [name for name, value in model.state_dict().items() if not torch.equal(value, ours[name])]
    assert changed and all("q_proj.bias" not in name and "linear1.bias" not in name for name in changed)


def test_interleaved_model_generates_the_same_with_hf():
    model = build_model(marian_like(1).config.replace(pe_layout="interleaved")).eval()
    model.load_state_dict(marian_like(1).state_dict())
    hf = to_marian(model, decoder_start_token_id=BOS)
    src = padded()
    ours = generate(model, src, bos_id=BOS, eos_id=2, config=GenerationConfig(max_new_tokens=10, num_beams=3))
    with torch.no_grad():
        out = hf.generate(input_ids=src, attention_mask=(src != PAD).long(), num_beams=3, max_length=11,
                          length_penalty=0.6, early_stopping=False)
    assert ours.tokens == [_strip(row, 2) for row in out]


def test_unmappable_models_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="sinusoidal positions"):
        to_marian(build_model(ModelConfig(vocab_size=20, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                                          n_decoder_layers=1, positional="learned")))
    with pytest.raises(ValueError, match="post-LN"):
        to_marian(marian_like(0, norm_first=True))
    hf = to_marian(marian_like(0))
    with torch.no_grad():
        hf.final_logits_bias.fill_(0.5)
    with pytest.raises(ValueError, match="final_logits_bias"):
        from_marian(hf)


def _emitted_token(model: torch.nn.Module, src: torch.Tensor) -> int:
    """A token that ends some greedy sentence mid-way when used as </s> (random models rarely emit a fixed one)."""
    out = generate(model, src, bos_id=BOS, eos_id=BOS, config=GenerationConfig(max_new_tokens=12))
    firsts = sorted({(t, token) for tokens in out.tokens for t, token in enumerate(tokens)
                     if token not in tokens[:t] and token != BOS}, reverse=True)
    for _, token in firsts:  # the token that first appears latest first
        ended = generate(model, src, bos_id=BOS, eos_id=token, config=GenerationConfig(max_new_tokens=12))
        if any(0 < len(t) < 12 for t in ended.tokens):
            return token
    return 2


def _strip(sequence: torch.Tensor, eos: int) -> list[int]:
    ids = sequence[1:].tolist()  # drop the decoder start token
    return ids[: ids.index(eos)] if eos in ids else ids


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_hf_generate_returns_the_same_sequences(seed, run_on):
    model = marian_like(seed)
    src = padded()
    eos = _emitted_token(model, src)
    # HF counts the decoder start token in max_length / min_length; aiayn counts new tokens only.
    hf = to_marian(model, decoder_start_token_id=BOS, eos_token_id=eos)
    settings = [(1, True, 0), (4, True, 0), (4, False, 0), (3, True, 2)]
    ended, seen = 0, set()
    module = run_on(model)
    for beam, early, min_len in settings:
        ours = generate(module, src, bos_id=BOS, eos_id=eos,
                        config=GenerationConfig(max_new_tokens=12, min_len=min_len, num_beams=beam,
                                                length_penalty=0.6, early_stopping=early))
        with torch.no_grad():
            out = hf.generate(input_ids=src, attention_mask=(src != PAD).long(), num_beams=beam, do_sample=False,
                              max_length=13, min_length=1 + min_len, length_penalty=0.6, early_stopping=early,
                              no_repeat_ngram_size=0, bad_words_ids=None, forced_eos_token_id=None,
                              repetition_penalty=1.0, output_scores=True, return_dict_in_generate=True)
        theirs = [_strip(row, eos) for row in out.sequences]
        assert ours.tokens == theirs, (beam, early, min_len)
        if beam > 1:
            torch.testing.assert_close(ours.scores, out.sequences_scores, atol=1e-4, rtol=1e-5)
        ended += sum(len(t) < 12 for t in ours.tokens)
        seen.update(tuple(t) for t in ours.tokens)
    assert len(seen) > 2  # varied outputs, not one degenerate sequence
    assert ended > 0  # some sentences ended with </s> before the length limit


@pytest.mark.parametrize("seed", [0, 1])
def test_runaway_guards_equal_hf_generate(seed):
    """repetition_penalty and no_repeat_ngram_size decode as Hugging Face's logits processors do."""
    model = marian_like(seed)
    src = padded()
    eos = _emitted_token(model, src)
    hf = to_marian(model, decoder_start_token_id=BOS, eos_token_id=eos)
    plain = generate(model, src, bos_id=BOS, eos_id=eos, config=GenerationConfig(max_new_tokens=12))
    changed = 0
    for beam, penalty, ngram in [(1, 1.5, 0), (1, 1.0, 2), (4, 1.3, 0), (3, 1.0, 3), (4, 1.2, 2)]:
        config = GenerationConfig(max_new_tokens=12, num_beams=beam, repetition_penalty=penalty,
                                  no_repeat_ngram_size=ngram)
        ours = generate(model, src, bos_id=BOS, eos_id=eos, config=config)
        with torch.no_grad():
            out = hf.generate(input_ids=src, attention_mask=(src != PAD).long(), num_beams=beam, do_sample=False,
                              max_length=13, length_penalty=0.6, early_stopping=False, repetition_penalty=penalty,
                              no_repeat_ngram_size=ngram)
        assert ours.tokens == [_strip(row, eos) for row in out], (beam, penalty, ngram)
        if ngram:
            for tokens in ours.tokens:
                grams = [tuple([BOS, *tokens][i : i + ngram]) for i in range(len(tokens) + 2 - ngram)]
                assert len(grams) == len(set(grams))
        changed += ours.tokens != plain.tokens if beam == 1 else 0
    assert changed  # the guards changed some greedy output: the comparison is not vacuous


def test_length_limit_relative_to_the_source():
    model = marian_like(2)
    src = padded()  # real lengths 7, 5, 3, 7
    out = generate(model, src, bos_id=BOS, eos_id=BOS, config=GenerationConfig(length_ratio=1.5, extra_len=2))
    assert [len(t) for t in out.tokens] == [12, 9, 6, 12]  # BOS never ends a sentence: every row runs to its limit
    with pytest.raises(ValueError, match="length_ratio must be a positive number"):
        GenerationConfig(length_ratio=0)
