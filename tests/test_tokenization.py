"""Tokenizers: the default kinds give text back exactly as it went in, on real text and random Unicode."""

import ast
import random
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiayn.tokenization import LOSSLESS_KINDS, Tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def stdlib_docstrings(limit_files: int = 120) -> list[str]:
    """Docstrings of the Python standard library: real prose, code, punctuation; no fixture tuned on them."""
    texts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:limit_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    texts.append(doc)
    random.Random(0).shuffle(texts)
    return texts


@pytest.fixture(scope="module")
def docstrings():
    texts = stdlib_docstrings()
    assert len(texts) > 1000
    return texts


@pytest.mark.parametrize("kind", LOSSLESS_KINDS)
def test_round_trip_is_exact_on_text_the_tokenizer_never_saw(kind, docstrings):
    half = len(docstrings) // 2
    tokenizer = train_tokenizer(docstrings[:half], vocab_size=4000, kind=kind)
    project_docs = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md"))]
    unseen = docstrings[half:] + project_docs + [(ROOT / "README.md").read_text(encoding="utf-8")]
    altered = [text for text in unseen if tokenizer.decode(tokenizer.encode(text)) != text]
    assert altered == []
    assert all(tokenizer.unk_id not in tokenizer.encode(text) for text in unseen)  # bytes, never <unk>


@pytest.fixture(scope="module", params=LOSSLESS_KINDS)
def small(request):
    texts = ["Can't open file.", "e-mail address, e.g. user@example.com", "Wait…", "naïve café", "日本語"] * 20
    return train_tokenizer(texts, vocab_size=300, kind=request.param)


# Any Unicode, with the characters the tokenizer itself uses (the space symbol, its escapes) drawn often.
SPECIAL_CHARS = st.sampled_from(["▁", "\ue000", "\ue001", "\ue002", " ", "<", "s", ">"])
TEXT = st.text(alphabet=st.one_of(st.characters(exclude_categories=("Cs",)), SPECIAL_CHARS), max_size=40)


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_round_trip_is_exact_on_random_unicode(small, text):
    assert small.decode(small.encode(text)) == text
    assert "".join(small.pieces(text)) == text


@pytest.mark.parametrize("text", ["", " ", "  two leading", "trailing  ", "a  b\tc\r\nd", "<s> and </s> as text",
                                  "zero\u200bwidth", "Ω ☃ 🙂", "…", "Can't", "the symbol ▁ is text", "▁▁ ▁",
                                  "\ue000\ue002 \ue000▁\ue001", "bytes such as <0xE2> are text"])
def test_edge_cases_round_trip_and_show_as_text(small, text):
    ids = small.encode(text)
    assert small.decode(ids) == text
    assert small.bos_id not in ids and small.eos_id not in ids  # a literal "<s>" is text, not the special token
    assert small.decode(small.encode(text, add_bos=True, add_eos=True)) == text  # the real ones are dropped
    assert "".join(small.pieces(text)) == text


def test_pieces_read_as_the_text_does():
    tokenizer = train_tokenizer(["Can't open the file."] * 50, vocab_size=200)
    assert tokenizer.tokenize("Can't open") == ["▁Can't", "▁open"]
    assert tokenizer.pieces("Can't open") == ["Can't", " open"]
    assert tokenizer.id_pieces(tokenizer.encode("open", add_eos=True)) == ["open", "</s>"]


def test_word_splitting_kinds_stay_available_and_are_not_lossless():
    tokenizer = train_tokenizer(["Can't open the file."] * 20, vocab_size=100, kind="subword-nmt")
    assert tokenizer.decode(tokenizer.encode("Can't open the file.")) == "Can ' t open the file ."
    assert "</w>" not in "".join(tokenizer.pieces("Can't"))


def test_small_corpus_gets_the_vocabulary_it_supports(caplog):
    with caplog.at_level("INFO", logger="aiayn.tokenization"):
        tokenizer = train_tokenizer(["one two three"] * 5, vocab_size=8000)
    assert tokenizer.vocab_size < 300 + 256
    assert "tokens learned of the" in caplog.text


def test_save_and_load_keep_the_literal_special_handling(tmp_path):
    tokenizer = train_tokenizer(["a <s> b"] * 10, vocab_size=100)
    tokenizer.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.encode("a <s> b") == tokenizer.encode("a <s> b")
    assert loaded.bos_id not in loaded.encode("a <s> b")


def test_the_tokenizer_is_callable_like_hugging_faces():
    import numpy as np
    import torch

    tok = train_tokenizer(["the cat sat on the mat", "a dog ran"] * 3, vocab_size=60)
    texts = ["the cat", "a dog ran on the mat", ""]
    batch = tok(texts, add_eos=True, return_tensors="pt")
    rows = [tok.encode(t, add_eos=True) for t in texts]
    width = max(len(r) for r in rows)
    assert batch["input_ids"].shape == (3, width) and batch["input_ids"].dtype == torch.long
    for i, row in enumerate(rows):
        assert batch["input_ids"][i, : len(row)].tolist() == row
        assert batch["attention_mask"][i].tolist() == [1] * len(row) + [0] * (width - len(row))
        assert set(batch["input_ids"][i, len(row):].tolist()) <= {tok.pad_id}
    one = tok("the cat", add_bos=True, add_eos=True)
    assert one["input_ids"] == tok.encode("the cat", add_bos=True, add_eos=True) and set(one["attention_mask"]) == {1}
    cut = tok("a dog ran on the mat", add_bos=True, add_eos=True, max_length=4, return_tensors="np")
    assert cut["input_ids"].shape == (1, 4) and cut["input_ids"].dtype == np.int64
    assert cut["input_ids"][0, 0] == tok.bos_id and cut["input_ids"][0, -1] == tok.eos_id
    with pytest.raises(ValueError, match="padding=True"):
        tok(texts, padding=False, return_tensors="pt")


def test_a_byte_tokenizer_reads_any_text_as_its_utf8_bytes_whatever_it_was_trained_on():
    tokenizer = train_tokenizer(["only ascii here"], vocab_size=8000, kind="byte")
    assert tokenizer.vocab_size == 4 + 256  # the special tokens and the bytes; vocab_size does not apply
    for text in ("naïve café", "日本語 ▁ <s>", "tab\there\n"):
        ids = tokenizer.encode(text)
        assert len(ids) == len(text.encode("utf-8")) and tokenizer.decode(ids) == text
    assert tokenizer.encode("é") == tokenizer.encode("\xc3\xa9".encode("latin-1").decode("utf-8"))
