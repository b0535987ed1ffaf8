"""ONNX export: ONNX Runtime equals PyTorch within 1e-4 at any batch size and length."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")

from aiayn.config import ModelConfig  # noqa: E402
from aiayn.interop.bert import load_pretrained  # noqa: E402
from aiayn.interop.onnx import export_onnx  # noqa: E402
from aiayn.nn.model import build_model  # noqa: E402


def _inputs(batch: int, length: int, vocab: int, pad_id: int = 0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(1, batch):  # every row after the first is padded by a different amount
        keep = max(1, length - row * 3)
        ids[row, keep:] = pad_id
        mask[row, keep:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def minilm_onnx(tmp_path_factory):
    model, _ = load_pretrained()
    path = export_onnx(model, tmp_path_factory.mktemp("onnx") / "model.onnx")
    return model, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("batch", "length"), [(1, 4), (3, 19), (5, 64)])
def test_onnx_runtime_equals_pytorch(minilm_onnx, batch, length):
    model, session = minilm_onnx
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    ids, mask = _inputs(batch, length, 30522, seed=batch)
    types = torch.zeros_like(ids)
    types[:, length // 2 :] = 1
    (ours,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                                 "token_type_ids": types.numpy()})
    with torch.inference_mode():
        ref = model.encode(ids, attention_mask=mask, token_type_ids=types).numpy()
    assert ours.shape == (batch, length, 384)
    assert np.abs(ours - ref).max() <= 1e-4


def test_onnx_export_of_a_paper_encoder_without_segments(tmp_path):
    cfg = ModelConfig(vocab_size=60, d_model=16, n_heads=4, d_ff=32, n_encoder_layers=2, n_decoder_layers=0,
                      max_len=64, dropout=0.0)
    model = build_model(cfg).eval()
    session = ort.InferenceSession(str(export_onnx(model, tmp_path / "m.onnx")), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    for batch, length in [(1, 3), (4, 33)]:
        ids, mask = _inputs(batch, length, 60)
        (ours,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
        with torch.inference_mode():
            ref = model.encode(ids, attention_mask=mask).numpy()
        assert np.abs(ours - ref).max() <= 1e-4
    assert model.training is False


def test_onnx_export_refuses_an_encoder_decoder(tmp_path):
    with pytest.raises(ValueError, match="only encoder-only models"):
        export_onnx(build_model(ModelConfig(vocab_size=20, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                                            n_decoder_layers=1)), tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()
