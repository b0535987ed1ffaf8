"""Data readers: malformed rows name file:line, empty lines and over-long rows are counted."""

import json

import pytest

from aiayn.data.prepare import prepare_data
from aiayn.data.readers import DataError, read_classification, read_conll, read_parallel, read_text
from aiayn.training.config import load_run_config


def test_tsv_parallel_reads_and_counts_empty_lines(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("one\teins\n\ntwo\tzwei\n\tdrei\nfour\t \n", encoding="utf-8")
    examples, stats = read_parallel(str(path))
    assert [(e.source, e.target) for e in examples] == [("one", "eins"), ("two", "zwei")]
    assert stats.kept == 2 and stats.empty == 1 and stats.empty_side == [4, 5]
    assert "1 empty lines skipped, 2 pairs with an empty side skipped (line 4, 5)" in stats.summary()


@pytest.mark.parametrize("content, message", [
    ("one\teins\ntwo zwei\n", ":2: expected 2 tab-separated columns"),
    ("a\tb\tc\n", ":1: expected 2 tab-separated columns"),
])
def test_malformed_tsv_rows_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.tsv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=message) as err:
        read_parallel(str(path))
    assert str(err.value).startswith(str(path))


def test_jsonl_parallel_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"source": "a", "target": "b"}) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        read_parallel(str(path))
    path.write_text(json.dumps({"source": "a"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:1: missing field 'target'"):
        read_parallel(str(path))


def test_two_aligned_files(tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eins\nzwei\n", encoding="utf-8")
    examples, _ = read_parallel(f"{tmp_path / 'a.en'},{tmp_path / 'a.de'}")
    assert [e.target for e in examples] == ["eins", "zwei"]
    (tmp_path / "a.de").write_text("eins\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"a.en:2: the aligned files have 2 and 1 lines"):
        read_parallel(f"{tmp_path / 'a.en'},{tmp_path / 'a.de'}")


def test_classification_csv_header_and_errors(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text('text,label\n"hello, world",pos\nbad row without label\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c.csv:3: expected 2 columns"):
        read_classification(str(path))
    path.write_text('text,label\n"hello, world",pos\n\nbye,neg\n', encoding="utf-8")
    examples, stats = read_classification(str(path))
    assert [(e.text, e.label) for e in examples] == [("hello, world", "pos"), ("bye", "neg")]
    assert stats.empty == 1


def test_conll_and_text(tmp_path):
    path = tmp_path / "t.conll"
    path.write_text("-DOCSTART- O\n\nJohn B-PER\nruns O\n\nParis B-LOC\n", encoding="utf-8")
    examples, _ = read_conll(str(path))
    assert [e.tags for e in examples] == [("B-PER", "O"), ("B-LOC",)]
    path.write_text("John B-PER\nlonely\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"t.conll:2: expected 'token tag'"):
        read_conll(str(path))
    text = tmp_path / "t.txt"
    text.write_text("a b\n\n c \n", encoding="utf-8")
    lines, stats = read_text(str(text))
    assert lines == ["a b", "c"] and stats.empty == 1


def test_rows_over_the_length_limit_are_dropped_and_counted(tmp_path):
    path = tmp_path / "train.tsv"
    rows = [f"w{i}\tv{i}" for i in range(30)] + ["a b c d e f g h i j k l\tx"]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    held = tmp_path / "held.tsv"
    held.write_text("w1\tv1\n", encoding="utf-8")
    run = load_run_config(None, [f"train={path}", f"valid={held}", f"test={held}", "max_source_len=6",
                                 "tokenizer=char"])
    data = prepare_data(run.train)
    assert data.stats[0].too_long == 1 and data.stats[0].kept == 30
    assert len(data.train.items) == 30
    assert "1 over the length limit dropped" in data.stats[0].summary()


def test_classic_mac_line_ends_are_lines(tmp_path):
    path = tmp_path / "mac.tsv"
    path.write_bytes(b"hello\thola\rgood night\tbuenas noches\r")
    examples, _ = read_parallel(str(path))
    assert [(e.source, e.target) for e in examples] == [("hello", "hola"), ("good night", "buenas noches")]
    windows = tmp_path / "windows.tsv"  # \r\n stays one line end, and a \r inside a line stays where there is \n
    windows.write_bytes(b"a\tb\r\nc\rd\te\n")
    examples, _ = read_parallel(str(windows))
    assert [(e.source, e.target) for e in examples] == [("a", "b"), ("c\rd", "e")]
