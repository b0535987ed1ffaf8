"""What a loaded object or command is given to run a model on: anything but texts is refused naming what to pass,
and a text longer than the model's `max_len` is refused naming `--truncate` (or cut when asked), by every
command and object alike."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.inference import Classifier, Embedder, Tagger, Translator
from aiayn.io import save_model
from aiayn.nn.model import build_model
from aiayn.tokenization import train_tokenizer

WORDS = ["the cat sat on the mat", "a dog ran in the park", "birds fly over the sea"] * 5
LONG = " ".join(["the cat sat on the mat"] * 20)  # 120 words, far past max_len 16


def saved(tmp_path, name, **changes):
    tokenizer = train_tokenizer(WORDS, vocab_size=60, kind="bpe")
    torch.manual_seed(0)
    settings = dict(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=0, max_len=16, dropout=0.0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, **{**settings, **changes})
    return save_model(build_model(cfg), tmp_path / name, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "translator": Translator.from_pretrained(saved(root, "translator", n_decoder_layers=1)),
        "classifier": Classifier.from_pretrained(saved(root, "classifier", head="sequence_classification",
                                                       num_labels=2)),
        "tagger": Tagger.from_pretrained(saved(root, "tagger", head="token_classification", num_labels=3)),
        "embedder": Embedder.from_pretrained(saved(root, "embedder")),
        "root": root,
    }


CALLS = {
    "Translator.translate": lambda m, texts: m["translator"].translate(texts, max_new_tokens=2),
    "Translator.translations": lambda m, texts: m["translator"].translations(texts),
    "Classifier.predict": lambda m, texts: m["classifier"].predict(texts),
    "Classifier.probabilities": lambda m, texts: m["classifier"].probabilities(texts),
    "Tagger.predict": lambda m, texts: m["tagger"].predict(texts),
    "Embedder.embed": lambda m, texts: m["embedder"].embed(texts),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("given, error, message", [
    (None, TypeError, r"^texts must be a string or a list of strings, got NoneType$"),
    (3, TypeError, r"^texts must be a string or a list of strings, got int$"),
    (b"the cat", ValueError, r"^texts must be a string or a list of strings, got bytes: decode it first"),
    (["the cat", None], TypeError, r"^text 2 is a NoneType, not a string$"),
    ({"the cat"}, TypeError, r"^texts must be a string or a list of strings, got set: it has no order"),
])
def test_anything_but_texts_is_refused_naming_what_to_pass(models, call, given, error, message):
    with pytest.raises(error, match=message):
        CALLS[call](models, given)


@pytest.mark.parametrize("call", ["Translator.translate", "Classifier.predict", "Tagger.predict"])
def test_a_text_past_max_len_is_refused_naming_truncate(models, call):
    with pytest.raises(ValueError, match=r"text 2 has \d+ tokens, more than the model's max_len \(16\); shorten "
                                         r"it or pass truncate=True \(--truncate\)"):
        CALLS[call](models, ["the cat", LONG])


def test_truncate_cuts_what_does_not_fit(models):
    assert models["classifier"].predict([LONG], truncate=True)[0].label in models["classifier"].labels
    tags = models["tagger"].predict(LONG, truncate=True)
    assert len(tags) == 120 and tags[0].tag is not None and tags[-1].tag is None


def test_an_embedder_with_sinusoidal_positions_keeps_to_max_len(models):
    # Hugging Face's truncation, to the model's positions whatever their kind (not 2**30 ids for sinusoidal ones)
    assert models["embedder"].max_length == 16
    assert models["embedder"].tokenize([LONG])[0].__len__() == 16


def test_predict_refuses_a_long_line_naming_its_line_and_truncate(models, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text(f"the cat\n\n{LONG}\n")
    run = str(models["root"] / "classifier")
    assert main(["predict", "--run", run, "--input", str(texts)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "line 3 has" in err and "max_len (16)" in err and "--truncate" in err
    assert main(["predict", "--run", run, "--input", str(texts), "--truncate"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_trace_keeps_to_max_len(models, capsys):
    run = str(models["root"] / "translator")
    assert main(["trace", "--run", run, LONG]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "more than the model's max_len (16): trace a shorter text" in err
    assert main(["trace", "--run", run, "the cat"]) == 0
