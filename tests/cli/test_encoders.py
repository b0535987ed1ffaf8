"""`aiayn embed`, `similarity` and `search`, run as docs/pretrained.md shows them."""

import io
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from aiayn.cli.main import main

CORPUS = "The cat sits on the mat.\nStocks fell sharply today.\n\nA kitten rests on a rug.\nParis is in France.\n"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_embed_arguments_to_npy(capsys, tmp_path):
    out = tmp_path / "vectors.npy"
    code, _, err = run(capsys, "embed", "A man is eating food.", "A man eats.", "-o", str(out))
    assert code == 0 and "wrote 2 vectors of width 384" in err
    vectors = np.load(out)
    assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_embed_file_and_stdin_to_jsonl(capsys, tmp_path, monkeypatch):
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("first line\n\nsecond line\n", encoding="utf-8")
    code, _, _ = run(capsys, "embed", "--input", str(sentences), "-o", str(tmp_path / "vectors.jsonl"))
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "vectors.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == ["first line", "second line"] and len(rows[0]["embedding"]) == 384
    monkeypatch.setattr("sys.stdin", io.StringIO(sentences.read_text()))
    code, out, _ = run(capsys, "embed")  # cat sentences.txt | aiayn embed > vectors.jsonl
    piped = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["text"] for r in piped] == ["first line", "second line"]
    np.testing.assert_allclose(piped[1]["embedding"], rows[1]["embedding"], atol=1e-6)


def test_embed_first_token_without_normalisation(capsys):
    code, out, _ = run(capsys, "embed", "--pooling", "first", "--no-normalize", "raw [CLS] state")
    vector = np.array(json.loads(out)["embedding"])
    assert code == 0 and vector.shape == (384,) and abs(np.linalg.norm(vector) - 1.0) > 0.01


def test_similarity_prints_a_cosine(capsys):
    code, out, _ = run(capsys, "similarity", "A man is eating food.", "Someone is having a meal.")
    assert code == 0 and 0.5 < float(out) <= 1.0


def test_search_builds_then_reuses_the_index(capsys, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    code, out, err = run(capsys, "search", "--corpus", str(corpus), "a small cat lying down", "-k", "3")
    lines = out.splitlines()
    assert code == 0 and "built index" in err and len(lines) == 3
    assert {line.split("\t")[1] for line in lines[:2]} == {"The cat sits on the mat.", "A kitten rests on a rug."}
    assert (tmp_path / "corpus.txt.aiayn-index.npz").is_file()
    code, out, err = run(capsys, "search", "--corpus", str(corpus), "markets crashed", "--json")
    result = json.loads(out)
    assert code == 0 and "reused index" in err
    assert result["results"][0] == {"rank": 1, "doc": 1, "score": result["results"][0]["score"],
                                    "text": "Stocks fell sharply today."}
    corpus.write_text(CORPUS + "Bond markets collapsed.\n", encoding="utf-8")
    code, _, err = run(capsys, "search", "--corpus", str(corpus), "markets crashed")
    assert code == 0 and "built index" in err


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    assert run(capsys, "embed", "--input", str(tmp_path / "missing.txt"))[2].count("\n") == 1
    code, _, err = run(capsys, "embed", "x", "-o", str(tmp_path / "v.csv"))
    assert code == 2 and "must end in .npy or .jsonl" in err
    code, _, err = run(capsys, "search", "--corpus", str(tmp_path / "none.txt"), "q")
    assert code == 2 and "corpus file" in err and "none.txt does not exist" in err
    code, _, err = run(capsys, "embed", "--model", str(tmp_path / "nowhere"), "x")
    assert code == 2 and "no such checkpoint directory" in err


def test_large_inputs_show_a_progress_bar(capsys, tmp_path, monkeypatch):
    from tqdm import tqdm

    monkeypatch.setattr("aiayn.cli.options.PROGRESS_FROM", 3)
    monkeypatch.setattr(tqdm, "monitor", None)  # none started yet in this process
    monkeypatch.setattr(tqdm, "monitor_interval", tqdm.monitor_interval)  # restored after the test
    sentences = tmp_path / "many.txt"
    sentences.write_text("".join(f"sentence number {i}\n" for i in range(5)), encoding="utf-8")
    code, _, err = run(capsys, "embed", "--input", str(sentences), "-o", str(tmp_path / "v.npy"))
    assert code == 0 and "embedding: 100%" in err and "5/5" in err
    assert tqdm.monitor is None  # the CLI's bars start no monitor thread: bf16's "aten" kernel needs none alive
    code, _, err = run(capsys, "embed", "--quiet", "--input", str(sentences), "-o", str(tmp_path / "v.npy"))
    assert code == 0 and "embedding:" not in err


def test_embed_in_bf16_stays_close_to_fp32(capsys, tmp_path):
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("A man is eating food.\nThe weather is lovely today.\n", encoding="utf-8")
    code, _, _ = run(capsys, "embed", "--precision", "bf16", "--input", str(sentences), "-o", str(tmp_path / "b.npy"))
    assert code == 0
    run(capsys, "embed", "--input", str(sentences), "-o", str(tmp_path / "f.npy"))
    cos = (np.load(tmp_path / "b.npy") * np.load(tmp_path / "f.npy")).sum(1)
    assert cos.shape == (2,) and cos.min() >= 0.999
