"""`aiayn embed`, `similarity`, `search` and `export`, run as docs/pretrained.md shows them."""

import io
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.io import save_model
from aiayn.nn.model import build_model
from aiayn.tokenization import train_tokenizer

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


def test_export_hf_default_model(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "minilm-hf"
    code, stdout, _ = run(capsys, "export", "--out", str(out))
    assert code == 0 and "wrote sentence-transformers files" in stdout
    model = transformers.AutoModel.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    batch = tok(["A man is eating food."], return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    vector = torch.nn.functional.normalize(hidden.mean(1), dim=1)[0].numpy()
    run(capsys, "embed", "A man is eating food.", "-o", str(tmp_path / "v.npy"))
    np.testing.assert_allclose(vector, np.load(tmp_path / "v.npy")[0], atol=1e-5)


def test_export_onnx_default_model(capsys, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    out = tmp_path / "minilm-onnx"
    code, stdout, _ = run(capsys, "export", "--onnx", "--out", str(out))
    assert code == 0 and (out / "tokenizer.json").is_file()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[101, 1037, 2158, 102]], dtype=np.int64)
    (hidden,) = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                   "token_type_ids": np.zeros_like(ids)})
    assert hidden.shape == (1, 4, 384)


def test_export_onnx_of_an_aiayn_encoder(capsys, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    texts = ["the cat sat on the mat", "a dog ran in the park", "birds fly over the sea"] * 5
    tokenizer = train_tokenizer(texts, vocab_size=60, kind="wordpiece")
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2,
                      n_decoder_layers=0, max_len=32, dropout=0.0)
    save_model(build_model(cfg), tmp_path / "enc", tokenizer=tokenizer)
    out = tmp_path / "enc-onnx"
    code, stdout, _ = run(capsys, "export", "--onnx", "--model", str(tmp_path / "enc"), "--out", str(out))
    assert code == 0 and (out / "model.onnx").is_file() and (out / "tokenizer.json").is_file()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[1, 5, 6, 7, 2], [1, 8, 2, 0, 0]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    (hidden,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
    assert hidden.shape == (2, 5, 16)
    code, stdout, _ = run(capsys, "embed", "--model", str(tmp_path / "enc"), "the cat ran")
    assert code == 0 and len(json.loads(stdout)["embedding"]) == 16


def test_large_inputs_show_a_progress_bar(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("aiayn.cli.options.PROGRESS_FROM", 3)
    sentences = tmp_path / "many.txt"
    sentences.write_text("".join(f"sentence number {i}\n" for i in range(5)), encoding="utf-8")
    code, _, err = run(capsys, "embed", "--input", str(sentences), "-o", str(tmp_path / "v.npy"))
    assert code == 0 and "embedding: 100%" in err and "5/5" in err
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
