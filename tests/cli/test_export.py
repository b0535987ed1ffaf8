"""`aiayn export` (aiayn/cli/export.py) of encoders, the default MiniLM and an aiayn encoder, to Hugging Face and
ONNX, loaded back by their libraries; tests/test_export.py tests `aiayn.export`, translators' exports and the checks."""

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


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


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
