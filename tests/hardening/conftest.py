"""The scene every hostile CLI case runs in: a trained run (`run/`, two checkpoints), a Hugging Face BERT checkpoint
(`bert/`), an aiayn encoder (`enc/`), an earlier export (`export/`), a plain file and files aiayn did not write;
and the table's `Case`, run in the scene by `refused` (the cases: tests/hardening/test_cli_*.py, by area)."""

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.interop.bert import export_hf
from aiayn.io import save_model
from aiayn.nn.model import build_model
from aiayn.tokenization import train_tokenizer

TINY_RUN = ["dataset=copy", "dataset_train=40", "dataset_valid=4", "dataset_test=4", "dataset_max_len=4",
            "vocab_size=20", "max_tokens=100", "threads=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
            "model.n_encoder_layers=1", "model.n_decoder_layers=1", "warmup=10", "show_examples=0"]
WORDS = ["the cat sat on the mat", "a dog ran in the park", "birds fly over the sea"] * 5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A trained run with two checkpoints, a BERT checkpoint, an aiayn encoder and an export (built once)."""
    root = tmp_path_factory.mktemp("assets")
    assert main(["train", *TINY_RUN, "max_steps=2", "save_every=1", "--run", str(root / "run"), "--no-progress"]) == 0
    tokenizer = train_tokenizer(WORDS, vocab_size=60, kind="wordpiece")
    torch.manual_seed(0)
    # BERT's options, so that the encoder also exports to Hugging Face format
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                      n_decoder_layers=0, max_len=32, positional="learned", embedding_norm=True, dropout=0.0,
                      scale_embeddings=False, activation="gelu", type_vocab_size=2, layer_norm_eps=1e-12)
    save_model(build_model(cfg), root / "enc", tokenizer=tokenizer)
    bert = build_model(cfg)
    export_hf(bert, tokenizer, root / "bert")
    assert main(["export", "--model", str(root / "enc"), "--out", str(root / "export")]) == 0
    return root


@pytest.fixture
def scene(assets, tmp_path, monkeypatch):
    for name in ("run", "bert", "enc", "export"):
        shutil.copytree(assets / name, tmp_path / name)
    (tmp_path / "config.json").write_text('{"mine": true}\n')  # files the user keeps in their directory
    (tmp_path / "metrics.csv").write_text("their,own\n1,2\n")
    (tmp_path / "notes.txt").write_text("a plain file\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "good.tsv").write_text("".join(f"w{i}\tv{i}\n" for i in range(20)))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def truncate(path, keep=0.5):
    def prepare(scene):
        data = Path(scene, path).read_bytes()
        Path(scene, path).write_bytes(data[: int(len(data) * keep)])
    return prepare


def write(path, text):
    return lambda scene: Path(scene, path).write_text(text, encoding="utf-8")


def edit_json(path, change):
    def prepare(scene):
        data = json.loads(Path(scene, path).read_text())
        change(data)
        Path(scene, path).write_text(json.dumps(data))
    return prepare


HELD: list = []  # locks a case holds, released after it


@dataclass
class Case:
    id: str
    argv: list
    code: int
    message: str
    prepare: object = None
    patch: object = None
    new_files: bool = False
    ignore: tuple = field(default_factory=tuple)


@pytest.fixture
def refused(scene, frozen, monkeypatch, capsys):
    """`refused(case)` runs a `Case` in the scene: one line `aiayn CMD: error: ...` matching its message, its exit
    code, every file that existed before byte-for-byte as it was, and no code from a pickle run."""

    def run(case):
        if case.prepare:
            case.prepare(scene)
        if case.patch:
            case.patch(monkeypatch)
        check = frozen(scene)
        try:
            code = main(case.argv)
        except SystemExit as stop:  # argparse's own errors
            code = stop.code
        err = capsys.readouterr().err
        command = case.argv[0]
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == case.code, err
        assert len(lines) == 1 and lines[0].startswith(f"aiayn {command}: error: "), err
        assert re.search(case.message, lines[0]), lines[0]
        check(new_files=case.new_files, ignore=(".aiayn.lock", "run/.aiayn.lock"))
        assert not Path(scene, "pwned.txt").exists()
        while HELD:
            HELD.pop().release()

    return run
