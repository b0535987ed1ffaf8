"""Generation: cached == recomputed, beam 1 == greedy, batch == one by one, EOS / lengths / empty input."""

import importlib.util

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.inference.generation import GenerationConfig, generate
from aiayn.inference.searches import BeamSearch, drive
from aiayn.inference.steps import start as start_decoding
from aiayn.nn.attention import attention_weights
from aiayn.nn.model import build_model
from tests.conftest import around_steps

BOS, EOS, PAD = 1, 2, 0


def make_model(seed: int = 0, vocab: int = 24, scale: float = 3.0):
    """A tiny random model whose outputs vary (feed-forward weights scaled up)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                      dropout=0.0, max_len=64)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "feed_forward" in name:
                p.mul_(scale)
    return model


def count_steps(monkeypatch, seen) -> None:
    """Call `seen(tokens)` with the (N, 1) tokens of every decoding step that `generate` runs."""
    around_steps(monkeypatch, lambda step, tokens: (seen(tokens), step(tokens))[1])


def padded_sources(vocab: int = 24) -> torch.Tensor:
    src = torch.randint(4, vocab, (4, 7))
    src[1, 5:] = PAD
    src[2, 3:] = PAD
    return src


@torch.no_grad()
def test_cached_decoding_equals_full_recomputation(run_on):
    model = run_on(make_model())
    src = padded_sources()
    out = generate(model, src, bos_id=BOS, eos_id=EOS, config=GenerationConfig(max_new_tokens=10))
    mask = model.source_mask(src)
    memory = model.encode(src, mask)
    cache = model.new_cache()
    steps = max(len(t) for t in out.tokens)
    prefix = torch.full((4, 1), BOS)
    with torch.no_grad():
        for t in range(steps):
            cached = model.head(model.decode(prefix[:, -1:], memory, memory_mask=mask, cache=cache))[:, -1]
            full = model.head(model.decode(prefix, memory, memory_mask=mask))[:, -1]
            torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)
            chosen = cached.argmax(-1)
            for i, tokens in enumerate(out.tokens):
                if t < len(tokens):
                    assert int(chosen[i]) == tokens[t]
            prefix = torch.cat([prefix, chosen[:, None]], dim=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.no_grad()
def test_num_beams_one_equals_greedy(seed, run_on):
    model = run_on(make_model(seed))
    src = padded_sources()
    greedy = generate(model, src, bos_id=BOS, eos_id=EOS, config=GenerationConfig(max_new_tokens=12))
    # generate() sends num_beams=1 to the greedy loop; the beam search code with one beam must agree.
    limits = torch.full((4,), 12)
    config = GenerationConfig(max_new_tokens=12, length_penalty=0.6)
    def begin(steps, beams, record):
        return start_decoding(model, src, steps, beams=beams, record=record)

    start = torch.full((4, 1), BOS)
    tokens, scores, _ = drive(BeamSearch(start, limits, EOS, config), begin(12, 1, False))
    assert tokens == greedy.tokens
    # A beam of one scores sum(log p) / length ** alpha, the length counting </s> when emitted.
    lengths = torch.tensor([min(len(t) + 1, 12) for t in tokens], dtype=torch.float)
    torch.testing.assert_close(scores * lengths**0.6, greedy.scores, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
def test_batch_equals_one_by_one(beam, run_on):
    model = run_on(make_model(3))
    src = padded_sources()
    config = GenerationConfig(num_beams=beam, max_new_tokens=12)
    batch = generate(model, src, bos_id=BOS, eos_id=EOS, config=config)
    for i in range(src.shape[0]):
        alone = generate(model, src[i : i + 1], bos_id=BOS, eos_id=EOS, config=config)
        assert alone.tokens[0] == batch.tokens[i]
        torch.testing.assert_close(alone.scores[0], batch.scores[i], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
def test_finished_sentences_leave_the_batch_and_the_others_decode_as_alone(beam, run_on, monkeypatch):

    model = run_on(make_model(4))
    torch.manual_seed(5)
    src = torch.randint(4, 24, (9, 9))
    for i, length in enumerate([9, 2, 5, 3, 9, 1, 7, 4, 6]):
        src[i, length:] = PAD
    # Each sentence runs to its own limit (real length + 3) or ends at </s> before: they finish at different steps.
    config = GenerationConfig(num_beams=beam, extra_len=3)
    rows = []  # the batch of every step
    count_steps(monkeypatch, lambda tokens: rows.append(tokens.shape[0]))
    batch = generate(model, src, bos_id=BOS, eos_id=EOS, config=config)
    assert rows[0] == 9 * beam and rows[-1] < rows[0] and rows == sorted(rows, reverse=True)
    for i in range(src.shape[0]):
        alone = generate(model, src[i : i + 1], bos_id=BOS, eos_id=EOS, config=config)
        assert alone.tokens[0] == batch.tokens[i]
        torch.testing.assert_close(alone.scores[0], batch.scores[i], atol=1e-4, rtol=1e-5)
    assert [len(t) <= int((s != PAD).sum()) + 3 for t, s in zip(batch.tokens, src)] == [True] * 9


@pytest.mark.parametrize("beam", [1, 4])
def test_on_finished_hears_each_sentence_once_as_it_leaves_the_batch(beam, monkeypatch):

    model = make_model(4)
    src = torch.randint(4, 24, (6, 9))
    for i, length in enumerate([9, 2, 0, 5, 1, 7]):
        src[i, length:] = PAD  # sentence 2 is empty
    steps, heard = [], []
    count_steps(monkeypatch, lambda tokens: steps.append(1))
    config = GenerationConfig(num_beams=beam, extra_len=3, min_len=64)  # each runs to its own limit
    out = generate(model, src, bos_id=BOS, eos_id=EOS, config=config,
                   on_finished=lambda i, tokens, score: heard.append((i, tokens, score, len(steps))))
    assert sorted(i for i, *_ in heard) == list(range(6))
    for i, tokens, score, _ in heard:
        assert tokens == out.tokens[i] and score == pytest.approx(float(out.scores[i]))
    when = {i: at for i, _, _, at in heard}
    assert when[4] < when[1] < when[3] < when[5] < len(steps)  # the shortest limits first, before the last step
    assert when[2] == len(steps)  # (the empty one at the end, with those that never left)


def test_sampling_and_recorded_attention_keep_every_row(monkeypatch):

    model = make_model(4)
    src = padded_sources()
    rows = []
    count_steps(monkeypatch, lambda tokens: rows.append(tokens.shape[0]))
    for config in (GenerationConfig(do_sample=True, seed=0, extra_len=3),
                   GenerationConfig(return_attention=True, extra_len=3),
                   GenerationConfig(return_attention=True, num_beams=3, extra_len=3)):
        rows.clear()
        generate(model, src, bos_id=BOS, eos_id=EOS, config=config)
        assert set(rows) == {4 * config.num_beams}


def test_eos_ends_a_sentence_and_is_not_returned():
    model = make_model(1)
    src = padded_sources()
    free = generate(model, src, bos_id=BOS, eos_id=EOS, config=GenerationConfig(max_new_tokens=12))
    # Make the first output token of sentence 0 the end-of-sentence token: that sentence becomes empty.
    first = free.tokens[0][0]
    out = generate(model, src[:1], bos_id=BOS, eos_id=first, config=GenerationConfig(max_new_tokens=12))
    assert out.tokens == [[]]
    # With min_len the same token cannot end it before 3 tokens.
    out = generate(model, src[:1], bos_id=BOS, eos_id=first, config=GenerationConfig(max_new_tokens=12, min_len=3))
    assert len(out.tokens[0]) >= 3 and first not in out.tokens[0][:3]


def test_max_new_tokens_caps_the_output_and_defaults_to_source_length_plus_extra():
    model = make_model(0)
    src = padded_sources()
    eos_out_of_reach = model.config.vocab_size - 1
    for beam in (1, 3):
        out = generate(model, src, bos_id=BOS, eos_id=eos_out_of_reach,
                       config=GenerationConfig(max_new_tokens=5, num_beams=beam, min_len=5))
        assert [len(t) for t in out.tokens] == [5, 5, 5, 5]
    out = generate(model, src, bos_id=BOS, eos_id=eos_out_of_reach,
                   config=GenerationConfig(extra_len=2, min_len=64))
    assert [len(t) for t in out.tokens] == [9, 7, 5, 9]  # real source length + 2 per sentence


def test_max_len_is_the_old_spelling_of_max_new_tokens():
    # Code written before the rename keeps running: max_len=n is max_new_tokens=n, named as it was spelled.
    assert GenerationConfig(max_len=5, num_beams=2) == GenerationConfig(max_new_tokens=5, num_beams=2)
    assert GenerationConfig(max_len=5, max_new_tokens=5).max_new_tokens == 5
    assert "max_len" not in repr(GenerationConfig(max_len=5))
    with pytest.raises(ValueError, match=r"^max_len=5 and max_new_tokens=6 disagree"):
        GenerationConfig(max_len=5, max_new_tokens=6)
    with pytest.raises(ValueError, match=r"^max_len must be a positive integer or None, got 0$"):
        GenerationConfig(max_len=0)
    with pytest.raises(ValueError, match=r"^min_len 9 is above max_new_tokens 4"):
        GenerationConfig(min_len=9, max_new_tokens=4)


def test_beam_size_is_the_old_spelling_of_num_beams():
    # Code written before the rename keeps running: beam_size=n is num_beams=n, named as it was spelled.
    assert GenerationConfig(beam_size=3) == GenerationConfig(num_beams=3)
    assert GenerationConfig(beam_size=3, num_beams=3).num_beams == 3
    assert "beam_size" not in repr(GenerationConfig(beam_size=3))
    with pytest.raises(ValueError, match=r"^beam_size=3 and num_beams=2 disagree"):
        GenerationConfig(beam_size=3, num_beams=2)
    with pytest.raises(ValueError, match=r"^beam_size must be a positive integer, got 0$"):
        GenerationConfig(beam_size=0)
    with pytest.raises(ValueError, match="use beam_size=1"):
        GenerationConfig(beam_size=4, do_sample=True)


def test_empty_input_gives_empty_output():
    model = make_model()
    out = generate(model, torch.zeros(2, 0, dtype=torch.long), bos_id=BOS, eos_id=EOS)
    assert out.tokens == [[], []] and out.scores.tolist() == [0.0, 0.0]
    src = padded_sources()
    src[2] = PAD  # a sentence of padding only, inside a batch
    out = generate(model, src, bos_id=BOS, eos_id=EOS, config=GenerationConfig(max_new_tokens=6, num_beams=2))
    assert out.tokens[2] == [] and out.tokens[0]


def test_too_long_source_and_bad_settings_raise_clear_errors():
    model = make_model()
    with pytest.raises(ValueError, match="longer than the model's max_len"):
        generate(model, torch.ones(1, 65, dtype=torch.long), bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        generate(model, padded_sources(), bos_id=BOS, eos_id=24)
    with pytest.raises(ValueError, match="num_beams"):
        GenerationConfig(num_beams=0)
    with pytest.raises(ValueError, match="use num_beams=1"):
        GenerationConfig(num_beams=4, do_sample=True)
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=0.0)


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    model = make_model(2)
    src = padded_sources()
    config = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.5, top_p=0.9, seed=7)
    first = generate(model, src, bos_id=BOS, eos_id=EOS, config=config)
    again = generate(model, src, bos_id=BOS, eos_id=EOS, config=config)
    assert first.tokens == again.tokens
    greedy = generate(model, src, bos_id=BOS, eos_id=EOS, config=GenerationConfig(max_new_tokens=10))
    top1 = generate(model, src, bos_id=BOS, eos_id=EOS,
                    config=GenerationConfig(max_new_tokens=10, do_sample=True, top_k=1, seed=3))
    assert top1.tokens == greedy.tokens
    others = {tuple(map(tuple, generate(model, src, bos_id=BOS, eos_id=EOS, config=GenerationConfig(
        max_new_tokens=10, do_sample=True, temperature=2.0, seed=s)).tokens)) for s in range(4)}
    assert len(others) > 1


@pytest.mark.parametrize("beam", [1, 3])
def test_attention_weights_on_request(beam):
    model = make_model(1)
    src = padded_sources()
    config = GenerationConfig(max_new_tokens=8, num_beams=beam)
    plain = generate(model, src, bos_id=BOS, eos_id=EOS, config=config)
    out = generate(model, src, bos_id=BOS, eos_id=EOS,
                   config=GenerationConfig(max_new_tokens=8, num_beams=beam, return_attention=True))
    assert out.tokens == plain.tokens and plain.attention is None
    for i, weights in enumerate(out.attention):
        assert weights.shape == (2, 4, len(out.tokens[i]), int((src[i] != PAD).sum()))
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    # The weights are those of full recomputation over the chosen output.
    i = 0
    tgt = torch.tensor([[BOS] + out.tokens[i][:-1]])
    source = src[i : i + 1, : int((src[i] != PAD).sum())]
    with torch.no_grad():
        with attention_weights([layer.cross_attn for layer in model.decoder.layers]) as cross:
            model.decode(tgt, model.encode(source))  # cross: n_layers x (1, h, T, S)
    torch.testing.assert_close(out.attention[i][-1], cross[-1][0], atol=1e-5, rtol=0)


def test_benchmark_runs(capsys):
    from aiayn.cli.bench import load_benchmark

    main = load_benchmark("generate").main
    assert main(["--quick", "--preset", "tiny", "--batches", "1", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "greedy" in out and "beam-4" in out and "step time" in out
    assert "int8 vs fp32" in out and "fp32 vs HF" in out
    assert "cross-attention absorbed into the memory" in out  # the CPU backend absorbs: the bench shows what it gains
    if importlib.util.find_spec("ctranslate2") is not None:  # the optional extra: the same weights, converted
        assert "CTranslate2 int8" in out and "int8 vs CT2" in out


@pytest.mark.parametrize("vocab", [50, 2000, 37000])
def test_topk_rows_equals_topk(vocab):
    # Beam search takes each beam's best tokens through blocks' maxima: the same values and ids as topk.
    from aiayn.inference.searches import topk_rows

    x = torch.randn(6, vocab)
    x[2] = float("-inf")
    x[2, vocab - 1] = 0.5  # the best entry of a row past the last whole block
    x[4, :] = x[4].abs() * -1
    x[4, 3] = 9.0
    values, ids = topk_rows(x, 8)
    expected = x.topk(8, dim=-1)
    torch.testing.assert_close(values, expected.values, atol=0, rtol=0)
    for row in (0, 1, 3, 4, 5):  # row 2 ties at -inf after its first entry: any order of those is right
        assert torch.equal(ids[row], expected.indices[row])
    assert int(ids[2, 0]) == vocab - 1 and int(ids[4, 0]) == 3


def test_tiny_vocabulary_beam():
    # More candidates (2 x beam) than the vocabulary offers on the first step: still a full-length answer.
    small = make_model(0, vocab=5)
    out = generate(small, torch.tensor([[4, 3, 4]]), bos_id=BOS, eos_id=4,
                   config=GenerationConfig(max_new_tokens=4, min_len=4, num_beams=4))
    assert len(out.tokens[0]) == 4 and torch.isfinite(out.scores).all()


def test_training_mode_is_restored_and_left_padding_is_kept():
    model = make_model(1)
    src = padded_sources()
    expected = generate(model, src, bos_id=BOS, eos_id=EOS, config=GenerationConfig(max_new_tokens=6)).tokens
    model.train()
    assert generate(model, src, bos_id=BOS, eos_id=EOS, config=GenerationConfig(max_new_tokens=6)).tokens == expected
    assert model.training
    # Padding on the left is masked too; no real token is cut off.
    left = torch.full((1, 9), PAD)
    left[0, 4:] = src[1, :5]
    out = generate(model, left, bos_id=BOS, eos_id=EOS,
                   config=GenerationConfig(max_new_tokens=6, return_attention=True))
    assert out.attention[0].shape[-1] == 5


@pytest.mark.parametrize("vocab", [50, 2000, 37000, 37010])
def test_argmax_rows_equals_argmax(vocab):
    # Greedy decoding takes each row's best token through blocks' maxima: argmax's index, ties and NaN included.
    from aiayn.inference.searches import argmax_rows

    x = torch.randn(8, vocab)
    x[1, :] = 0.0  # all equal: the first
    x[2, 10], x[2, vocab - 1] = 5.0, 5.0  # equal maxima in a block and past the last whole block: the first
    x[3, vocab - 1] = 9.0  # the best entry past the last whole block
    x[4, 7], x[4, vocab // 2] = float("nan"), float("nan")  # NaN: the first, as argmax
    x[5, vocab - 1] = float("nan")
    x[6] = float("-inf")
    for rows in (x, x[:1], x[3:4]):
        assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))


class _ScriptedDecoder:
    """A confident model of one sentence, 3 4 5 6 `</s>`: after token t the next is `NEXT[t]` with probability ~0.9;
    the slips are `</s>` (~0.035) and the token after the next (~0.03: a skip, whose beam ends a step early). The
    slips differ: tied candidates would be ordered by the top-k kernel, which differs between CPU kinds."""

    NEXT = {BOS: 3, 3: 4, 4: 5, 5: 6, 6: EOS}
    VOCAB = 10

    def __init__(self):
        self.attention = None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        probs = torch.full((tokens.shape[0], self.VOCAB), 1e-3)
        probs[:, BOS] = 0.0
        for row, token in enumerate(tokens[:, 0].tolist()):
            intended = self.NEXT.get(token, EOS)
            probs[row, self.NEXT.get(intended, EOS)] = 0.03
            probs[row, EOS] = 0.035
            probs[row, intended] = 0.9
        return (probs / probs.sum(dim=1, keepdim=True)).clamp_min(1e-12).log()

    def reorder(self, rows: torch.Tensor, *, memory_rows: torch.Tensor | None = None) -> None:
        pass  # the next token depends on the newest one only


@pytest.mark.parametrize("beam", [2, 4])
def test_beam_search_keeps_searching_while_its_best_beam_runs(beam):
    # Beams that skip a token finish first, with poor scores: stopping once `beam` hypotheses have finished
    # returns one of them while the best beam (greedy's sentence) is still running; the default search
    # continues while that beam can still beat the worst finished one, as Hugging Face's `generate()`.
    def search(early_stopping: bool) -> list[int]:
        config = GenerationConfig(max_new_tokens=10, num_beams=beam, early_stopping=early_stopping)
        tokens, _, _ = drive(BeamSearch(torch.tensor([[BOS]]), torch.tensor([10]), EOS, config), _ScriptedDecoder())
        return tokens[0]

    assert GenerationConfig().early_stopping is False
    assert search(False) == [3, 4, 5, 6]
    assert search(True) != [3, 4, 5, 6]  # the rule the default replaced: a shorter, worse sentence


@torch.no_grad()
def test_scores_not_asked_for_leave_the_search_as_it_was_and_come_back_as_nan(monkeypatch):
    model = make_model(3)
    src = padded_sources()
    asked = []
    original = torch.nn.functional.log_softmax
    monkeypatch.setattr(torch.nn.functional, "log_softmax", lambda *a, **k: (asked.append(1), original(*a, **k))[1])
    for settings in (dict(), dict(do_sample=True, temperature=1.5, seed=5), dict(repetition_penalty=1.3, min_len=4)):
        scored = generate(model, src, bos_id=BOS, eos_id=EOS, config=GenerationConfig(max_new_tokens=12, **settings))
        assert asked and not scored.scores.isnan().any()
        asked.clear()
        unscored = generate(model, src, bos_id=BOS, eos_id=EOS,
                            config=GenerationConfig(max_new_tokens=12, return_scores=False, **settings))
        assert not asked, "no log-softmax over the vocabulary without scores"
        assert unscored.tokens == scored.tokens and unscored.scores.isnan().all()
    # Beam search searches by its scores: it returns them whatever was asked
    beams = [generate(model, src, bos_id=BOS, eos_id=EOS,
                      config=GenerationConfig(max_new_tokens=12, num_beams=3, return_scores=scoring))
             for scoring in (True, False)]
    assert beams[0].tokens == beams[1].tokens
    torch.testing.assert_close(beams[0].scores, beams[1].scores)


@pytest.mark.parametrize("settings", [dict(top_k=5), dict(top_p=0.9), dict(temperature=0.5), dict(top_k=2, top_p=0.5)])
def test_a_sampling_warper_without_sampling_is_refused_not_ignored(settings):
    with pytest.raises(ValueError, match=r"shapes? sampling only: set do_sample=True"):
        GenerationConfig(**settings)
    assert GenerationConfig(do_sample=True, **settings).do_sample  # with sampling, as Hugging Face's generate()
