"""The files a run, a saved model and an export write have the modes a plain `open` would give them under the
umask, all alike (a writer that makes its file private, as safetensors does, is corrected), and a file that is
replaced keeps its mode."""

import os
import stat

import pytest
import torch

from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.io import save_model
from aiayn.nn.model import build_model
from aiayn.rundir import atomic_write_bytes
from aiayn.tokenization import train_tokenizer

TINY_RUN = ["dataset=copy", "dataset_train=40", "dataset_valid=4", "dataset_test=4", "dataset_max_len=4",
            "vocab_size=20", "max_tokens=100", "threads=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
            "model.n_encoder_layers=1", "model.n_decoder_layers=1", "warmup=10", "show_examples=0"]
WORDS = ["the cat sat on the mat", "a dog ran in the park", "birds fly over the sea"] * 5


@pytest.fixture
def umask():
    def set_to(mask):
        os.umask(mask)
    before = os.umask(0o022)
    os.umask(before)
    yield set_to
    os.umask(before)


def modes(directory):
    return {str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode) for p in directory.rglob("*")
            if p.is_file() and p.name != ".aiayn.lock"}


@pytest.mark.parametrize("mask", [0o002, 0o027])
def test_every_file_of_a_run_has_the_mode_the_umask_gives(tmp_path, umask, mask):
    umask(mask)
    assert main(["train", *TINY_RUN, "max_steps=2", "save_every=1", "--run", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    found = modes(tmp_path / "run")
    assert "model.safetensors" in found and "checkpoints/step-00000001/model.safetensors" in found
    assert {name: mode for name, mode in found.items() if mode != 0o666 & ~mask} == {}


def test_a_saved_model_and_its_export_follow_the_umask(tmp_path, umask):
    umask(0o007)
    tokenizer = train_tokenizer(WORDS, vocab_size=60)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                      n_decoder_layers=0, max_len=16, dropout=0.0)
    save_model(build_model(cfg), tmp_path / "enc", tokenizer=tokenizer)
    assert set(modes(tmp_path / "enc").values()) == {0o660}
    assert main(["export", "--model", str(tmp_path / "enc"), "--onnx", "--out", str(tmp_path / "x"),
                 "--no-check"]) == 0
    assert set(modes(tmp_path / "x").values()) == {0o660}


def test_a_replaced_file_keeps_its_mode(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "config.json"
    atomic_write_bytes(path, b"{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    path.chmod(0o600)  # its owner made it private
    atomic_write_bytes(path, b'{"a": 1}')
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == b'{"a": 1}'
