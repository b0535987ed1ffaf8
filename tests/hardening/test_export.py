"""Exports never write inside a run or model directory, and an export that computes something else than aiayn is
never a success."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

import aiayn.export
from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.export import Agreement
from aiayn.io import save_model
from aiayn.nn.model import build_model
from aiayn.tokenization import train_tokenizer

WORDS = ["the cat sat on the mat", "a dog ran in the park", "birds fly over the sea"] * 5
TINY_RUN = ["dataset=copy", "dataset_train=40", "dataset_valid=4", "dataset_test=4", "dataset_max_len=4",
            "vocab_size=20", "max_tokens=100", "threads=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
            "model.n_encoder_layers=1", "model.n_decoder_layers=1", "warmup=10", "show_examples=0"]


def tree(directory):
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", *TINY_RUN, "max_steps=2", "save_every=1", "--run", str(run), "--no-progress"]) == 0
    return run


@pytest.fixture
def encoder(tmp_path):
    tokenizer = train_tokenizer(WORDS, vocab_size=60)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2,
                      n_decoder_layers=0, max_len=8, dropout=0.0)  # sinusoidal positions, 8 of them
    return save_model(build_model(cfg), tmp_path / "enc", tokenizer=tokenizer)


@pytest.mark.parametrize("inside", ["newexp", "checkpoints/x", "checkpoints", "source"])
def test_an_export_inside_a_run_is_refused(run_dir, capsys, inside):
    before = tree(run_dir)
    code = main(["export", "--run", str(run_dir), "--out", str(run_dir / inside)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0
    assert f"is inside {run_dir}" in err or f"{run_dir / inside} holds" in err
    assert "choose an --out directory outside it" in err or "choose a new --out directory" in err
    assert tree(run_dir) == before and not (run_dir / "newexp").exists()


def test_an_export_inside_a_model_directory_is_refused(encoder, capsys):
    before = tree(encoder)
    assert main(["export", "--model", str(encoder), "--onnx", "--out", str(encoder / "onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{encoder / 'onnx'} is inside {encoder}, which holds an aiayn model" in err
    assert tree(encoder) == before


def test_the_onnx_export_agrees_with_aiayn_on_a_text_past_max_len(encoder, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    assert main(["export", "--model", str(encoder), "--onnx", "--out", str(tmp_path / "x")]) == 0
    out = capsys.readouterr().out
    assert "11/11 agree" in out  # the check's last text is past max_len: both truncate it to 8 ids


def test_the_onnx_graph_refuses_inputs_past_max_len(encoder, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    assert main(["export", "--model", str(encoder), "--onnx", "--out", str(tmp_path / "x"), "--no-check"]) == 0
    session = ort.InferenceSession(str(tmp_path / "x" / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.full((1, 8), 5, dtype=np.int64)
    assert session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0].shape == (1, 8, 16)
    ids = np.full((1, 9), 5, dtype=np.int64)
    with pytest.raises(Exception, match="broadcast"):
        session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})


def test_an_export_that_disagrees_with_aiayn_exits_non_zero(encoder, tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(aiayn.export, "check_onnx", lambda embedder, out: [
        Agreement("ONNX Runtime, cosine >= 0.99999", 10, 11, "min cosine 0.9570000")])
    assert main(["export", "--model", str(encoder), "--onnx", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith(f"aiayn export: error: the export in {tmp_path / 'x'} computes something else than aiayn "
                          "on 1 of 11 check inputs")
    assert "min cosine 0.9570000" in err


def test_expected_differences_are_not_failures():
    assert not Agreement("ctranslate2, greedy", 7, 11, "quantized weights", required=False).failed
    assert not Agreement("ONNX Runtime: not checked", 0, 11, required=False).failed
    assert Agreement("ONNX Runtime", 10, 11).failed and not Agreement("ONNX Runtime", 11, 11).failed
