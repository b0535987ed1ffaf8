"""Embedder equals sentence-transformers' encode(); batching, pooling and the search index behave."""

import itertools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from aiayn.inference.embeddings import Embedder, encode_texts, length_sorted_batches
from aiayn.inference.search import SearchIndex
from aiayn.interop.bert import package_model_dir

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Café au lait, s'il vous plaît — merci!",
    "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
    "Why?",
    "Supercalifragilisticexpialidocious words confuse tokenizers",
    "Numbers like 3.14159, 2,718 and 1e-9 appear in text.",
    "",
    "A very long sentence " + "that keeps going and going " * 60,  # truncated at 256 tokens
    "Zwei Männer spielen Fußball im Regen.",
    "Two men play football in the rain.",
]


@pytest.fixture(scope="module")
def embedder():
    return Embedder.from_pretrained()


@pytest.fixture(scope="module")
def st_vectors():
    st_module = pytest.importorskip("sentence_transformers")
    model = st_module.SentenceTransformer(str(package_model_dir()), device="cpu")
    # One sentence per call: no padding at all on the reference side.
    return np.stack([model.encode([s], convert_to_numpy=True)[0] for s in SENTENCES])


def _check_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-5
    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.99999


@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_embeddings_equal_sentence_transformers(embedder, st_vectors, batch_size):
    assert (embedder.pooling, embedder.normalize, embedder.max_length) == ("mean", True, 256)
    _check_equal(embedder.embed(SENTENCES, batch_size=batch_size), st_vectors)


def test_padding_does_not_change_a_vector(embedder):
    short = SENTENCES[5]
    alone = embedder.embed([short])
    padded = embedder.embed([short, SENTENCES[4], SENTENCES[9]], batch_size=3)[0]
    np.testing.assert_allclose(padded, alone[0], atol=1e-6)


def test_cls_pooling_and_unnormalised_vectors(embedder):
    raw = Embedder(embedder.model, embedder.tokenizer, pooling="first", normalize=False, max_length=256)
    vectors = raw.embed(SENTENCES[:3])
    ids = torch.tensor(encode_texts(embedder.tokenizer, SENTENCES[:1], 256))
    with torch.inference_mode():
        cls_state = embedder.model.encode(ids)[0, 0].numpy()
    # Batched and padded on the backend's kernels against one unpadded sentence: two float32 summation
    # orders, which differ by about sqrt(K) eps of the largest value per product of width K (MiniLM's
    # widest is d_ff 1536), over 6 layers.
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(vectors[0], cls_state, rtol=0, atol=6 * 1536**0.5 * eps * np.abs(cls_state).max())
    assert not np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    with pytest.raises(ValueError, match="pooling must be one of"):
        Embedder(embedder.model, embedder.tokenizer, pooling="max")


def test_similarity_ranks_paraphrases_higher(embedder):
    assert embedder.similarity(SENTENCES[10], SENTENCES[11]) > embedder.similarity(SENTENCES[10], SENTENCES[4])
    assert embedder.embed([]).shape == (0, 384)
    with pytest.raises(TypeError, match="text 2 is a int"):  # counted from 1, as every loaded object counts
        embedder.embed(["fine", 3])


def test_length_sorted_batches_cover_everything_longest_first():
    lengths = [5, 1, 9, 3, 9, 2, 7]
    batches = length_sorted_batches(lengths, 3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths, reverse=True) and all(len(b) <= 3 for b in batches)
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        length_sorted_batches(lengths, 0)


def test_length_sorted_batches_split_off_a_long_text_rather_than_pad_to_it():
    from aiayn.inference.embeddings import CALL_COST_TOKENS as call

    # one long text among short ones runs alone: padding seven 10s to 200 costs far more than a second pass
    assert length_sorted_batches([10, 200, 10, 11, 10, 10, 10, 10], 16) == [[1], [3, 0, 2, 4, 5, 6, 7]]
    # equal lengths share a pass, up to batch_size
    assert sorted(len(b) for b in length_sorted_batches([30] * 40, 16)) == [8, 16, 16]
    # each cut is worth its pass: brute force over every way to cut five sorted lengths agrees
    lengths = [90, 64, 40, 38, 12]

    def total(batches):
        return sum(call + len(b) * lengths[b[0]] for b in batches)

    best = min(total([list(range(a, b)) for a, b in zip((0, *cuts), (*cuts, 5))])
               for n in range(5) for cuts in itertools.combinations(range(1, 5), n))
    assert total(length_sorted_batches(lengths, 5)) == best
    # without a cost (a GPU's passes): full batches of the sorted texts
    assert length_sorted_batches([10, 200, 10, 11], 3, call_cost=None) == [[1, 3, 0], [2]]


def test_bf16_embedder_stays_close(embedder):
    bf16 = embedder.with_precision("bf16")
    vectors, ref = bf16.embed(SENTENCES, batch_size=5), embedder.embed(SENTENCES)
    assert vectors.dtype == np.float32 and (vectors * ref).sum(1).min() >= 0.999
    assert embedder.with_precision("fp32") is embedder and bf16.backend.precision == "bf16"
    with pytest.raises(ValueError, match="precision must be one of"):
        embedder.with_precision("fp8")


def test_int8_embedder_stays_close(embedder):
    int8 = embedder.with_precision("int8")
    vectors = int8.embed(SENTENCES)
    ref = embedder.embed(SENTENCES)
    cos = (vectors * ref).sum(1)
    # the target int8 is held to: every sentence within cosine 0.99 of the float32 vector
    assert vectors.shape == ref.shape and cos.min() >= 0.99
    assert int8.name.endswith("(int8)")


def test_search_index_finds_saves_and_rebuilds(embedder, tmp_path):
    corpus = SENTENCES[:8]
    path = tmp_path / "index.npz"
    index, rebuilt = SearchIndex.load_or_build(path, corpus, embedder)
    assert rebuilt and path.is_file()
    hits = index.search(embedder.embed(["Someone eats a meal."])[0], k=2)
    assert [i for i, _ in hits] == [0, 1] and hits[0][1] >= hits[1][1]
    again, rebuilt = SearchIndex.load_or_build(path, corpus, embedder)
    assert not rebuilt
    np.testing.assert_array_equal(again.vectors, index.vectors)
    assert again.texts == corpus
    changed, rebuilt = SearchIndex.load_or_build(path, corpus + ["A new line."], embedder)
    assert rebuilt and len(changed.texts) == 9
    assert len(index.search(index.vectors[0], k=100)) == 8
    with pytest.raises(ValueError, match="k must be at least 1"):
        index.search(index.vectors[0], k=0)
    (tmp_path / "bad.npz").write_bytes(b"not an index")
    with pytest.raises(ValueError, match="not an aiayn search index"):
        SearchIndex.load(tmp_path / "bad.npz")


def test_embed_benchmark_runs_end_to_end(capsys):
    pytest.importorskip("sentence_transformers")
    from aiayn.cli.bench import load_benchmark

    script = load_benchmark("embed")
    main, make_corpus = script.main, script.make_corpus
    corpus = make_corpus(50)
    assert len(set(corpus)) == 50 and make_corpus(50) == corpus
    real = script.real_sentences(8)
    assert main(["--sentences", "16", "--repeats", "1", "--latency-calls", "2", "--precisions", "fp32,bf16",
                 "--real", "8"]) == 0
    out = capsys.readouterr().out
    assert "sentence-transformers" in out and "aiayn throughput vs sentence-transformers" in out
    assert ("min cos, 8 real" in out) == (len(real) == 8)  # real sentences where the machine has gettext catalogs
    assert "bf16: throughput vs aiayn fp32" in out


def test_the_docs_python_example_runs(tmp_path, monkeypatch):
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "pretrained.md").read_text(encoding="utf-8")
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/pretrained.md", "exec"), scope)
    assert scope["vectors"].shape == (2, 384)
    assert {row for row, _ in scope["hits"]} == {0, 2}
    assert (tmp_path / "corpus.index.npz").is_file() and scope["model"].config.d_model == 384


def test_backend_path_equals_the_plain_model_and_follows_weight_changes(embedder, measured):
    measured()  # stacked Q/K/V and prepacked weights, whatever this machine measured: converted weights to follow
    plain = Embedder(embedder.model, embedder.tokenizer, max_length=256, plain=True)
    fast = Embedder(embedder.model, embedder.tokenizer, max_length=256)
    assert plain.backend.plain and fast.backend.fused_qkv
    np.testing.assert_allclose(fast.embed(SENTENCES, batch_size=5), plain.embed(SENTENCES, batch_size=5), atol=1e-6)
    assert plain.prepared_model() is not embedder.model  # a copy of the modules ...
    assert plain.prepared_model().encoder.layers[0].self_attn.q_proj.weight is embedder.model.encoder.layers[
        0].self_attn.q_proj.weight  # ... sharing the parameters
    before = fast.prepared_model()
    assert fast.prepared_model() is before  # prepared once
    bias = embedder.model.encoder.layers[0].feed_forward.linear2.bias
    saved = bias.detach().clone()
    try:
        with torch.no_grad():
            bias.add_(0.5)  # a weight changed in place: a prepared copy with converted weights must be rebuilt
        assert fast.prepared_model() is not before
        np.testing.assert_allclose(fast.embed(SENTENCES[:3]), plain.embed(SENTENCES[:3]), atol=1e-6)
    finally:
        with torch.no_grad():
            bias.copy_(saved)
