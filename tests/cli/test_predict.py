"""`aiayn predict`: labels or tags for arguments, a file or stdin, as text or JSON; one output line per input line."""

import io
import json

from aiayn.cli.main import main
from tests.conftest import CLASSIFIED, TAGGED
from tests.inference.test_loading import tiny_encoder


def _run(capsys, *argv):
    code = main(["predict", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def test_classify_arguments_and_json(classification_run, capsys):
    code, lines, err = _run(capsys, "--run", str(classification_run), CLASSIFIED[1][0], "", CLASSIFIED[2][0])
    assert code == 0 and len(lines) == 3 and lines[1] == "" and "labels: neg, pos" in err
    assert [line.split("\t")[0] for line in (lines[0], lines[2])] == [CLASSIFIED[1][1], CLASSIFIED[2][1]]
    assert 0.5 < float(lines[0].split("\t")[1]) <= 1.0
    code, lines, _ = _run(capsys, "--run", str(classification_run), CLASSIFIED[1][0], "--json")
    row = json.loads(lines[0])
    assert row["text"] == CLASSIFIED[1][0] and row["label"] == CLASSIFIED[1][1] and set(row["scores"]) == {"neg", "pos"}


def test_tag_a_file_and_stdin(tagging_run, capsys, monkeypatch, tmp_path):
    text = "".join(" ".join(w for w, _ in s) + "\n" for s in TAGGED[:3]) + "\n"
    source = tmp_path / "in.txt"
    source.write_text(text, encoding="utf-8")
    code, lines, _ = _run(capsys, "--run", str(tagging_run), "--input", str(source))
    assert code == 0 and lines == [" ".join(f"{w}/{t}" for w, t in s) for s in TAGGED[:3]] + [""]
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    code, piped, _ = _run(capsys, "--run", str(tagging_run), "--json")
    rows = [json.loads(line) for line in piped]
    assert code == 0 and [[t["tag"] for t in r["tags"]] for r in rows] == [["B-PER", "O", "B-LOC"]] * 3 + [[]]


def test_a_run_of_another_kind_is_one_line(translation_run, capsys, tmp_path):
    code, _, err = _run(capsys, "--run", str(translation_run), "a b")
    assert code == 2 and "not a classification or tagging run; use aiayn translate" in err
    code, _, err = _run(capsys, "--run", str(tmp_path / "missing"), "a b")
    assert code == 2 and err.count("\n") == 1


def test_an_encoder_without_a_head_is_sent_to_embed(tmp_path, capsys):
    encoder = tiny_encoder(tmp_path)
    code, _, err = _run(capsys, "--run", str(encoder), "a b")
    assert code == 2 and "holds a model for an Embedder, not a classification or tagging run" in err
    assert f"use aiayn embed --model {encoder}" in err
