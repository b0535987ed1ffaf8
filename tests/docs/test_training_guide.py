"""Every command in docs/training.md runs (with tiny sizes appended so that each takes a second or two)."""

import re
import shlex
import shutil
from pathlib import Path

import pytest

from aiayn.cli.main import main
from aiayn.training import config as config_module
from tests.conftest import write_mo

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "training.md"
TINY_TRAIN = ["threads=1", "max_steps=3", "warmup=10", "max_tokens=200", "vocab_size=60", "dataset_train=50",
              "dataset_valid=10", "dataset_test=10", "show_examples=1"]
TINY_MODEL = ["model.d_model=16", "model.d_ff=32", "model.n_heads=2", "model.n_encoder_layers=1",
              "model.n_decoder_layers=1"]
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
GERMAN = ["eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn"]


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def _data(root: Path) -> None:
    data = root / "data"
    data.mkdir()
    pairs = [f"{WORDS[i % 10]} {WORDS[i // 10]}\t{GERMAN[i % 10]} {GERMAN[i // 10]}" for i in range(60)]
    for name in ("train", "valid", "test"):
        (data / f"{name}.tsv").write_text("\n".join(pairs) + "\n", encoding="utf-8")
    reviews = ["text,label"] + [f"{WORDS[i % 10]} is {'good' if i % 2 else 'bad'},{'pos' if i % 2 else 'neg'}"
                                for i in range(60)]
    (data / "reviews.csv").write_text("\n".join(reviews) + "\n", encoding="utf-8")
    ner = []
    for i in range(30):
        ner += [f"{WORDS[i % 10].title()} B-PER", "visits O", f"{GERMAN[i % 10].title()} B-LOC", ""]
    (data / "ner.conll").write_text("\n".join(ner) + "\n", encoding="utf-8")
    corpus = [" ".join(WORDS[(i + k) % 10] for k in range(8)) for i in range(60)]
    (data / "corpus.txt").write_text("\n".join(corpus) + "\n", encoding="utf-8")


def _catalogs(root: Path) -> Path:
    """A stand-in for /usr/share/locale: one French catalog of 60 messages (and one template to drop)."""
    messages = {f"{WORDS[i % 10].title()} {WORDS[i // 10]} files": f"{GERMAN[i % 10]} {GERMAN[i // 10]} fichiers"
                for i in range(60)}
    messages["Open %s"] = "Ouvrir %s"
    messages[""] = "Content-Type: text/plain; charset=UTF-8\n"  # the header entry names the encoding
    write_mo(root / "locale" / "fr" / "LC_MESSAGES" / "demo.mo", messages)
    return root / "locale"


def _with_tiny(argv: list[str]) -> list[str]:
    if argv[0] == "corpus":  # the machine's own catalogs vary; a small stand-in keeps the test exact and fast
        return argv + ["--locale-dir", "locale", "--valid", "5", "--test", "5"]
    if argv[0] != "train" or "--resume" in argv:
        return argv
    at = 2 if len(argv) > 1 and argv[1].endswith((".toml", ".json")) else 1
    tiny = TINY_TRAIN if "--init-from" in argv else TINY_TRAIN + TINY_MODEL
    return argv[:at] + tiny + argv[at:] + ["--no-progress"]


def test_every_documented_command_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _data(tmp_path)
    _catalogs(tmp_path)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # the shipped configs, as in a checkout
    (tmp_path / "run.toml").write_text(_blocks("toml")[0], encoding="utf-8")
    demo = (ROOT / "examples" / "demo.toml").read_text(encoding="utf-8")
    tiny_demo = tmp_path / "demo.toml"  # the shipped demo, cut down to seconds
    for big, small in (("dataset_train = 8000", "dataset_train = 60"), ("dataset_valid = 300", "dataset_valid = 10"),
                       ("dataset_test = 500", "dataset_test = 10"), ("epochs = 20", "epochs = 1"),
                       ("average_last = 5", "average_last = 0"), ("d_model = 128", "d_model = 16"),
                       ("d_ff = 256", "d_ff = 32")):
        assert big in demo
        demo = demo.replace(big, small)
    tiny_demo.write_text(demo, encoding="utf-8")
    monkeypatch.setattr(config_module, "example_config", lambda name: tiny_demo)
    commands = [line for block in _blocks("sh") for line in block.splitlines() if line.startswith("aiayn ")]
    assert len(commands) >= 12
    for command in commands:
        argv = _with_tiny(shlex.split(command)[1:])
        assert main(argv) == 0, f"{command}: {capsys.readouterr()}"
    out = capsys.readouterr().out
    assert "exact_match" in out and "bleu" in out
    assert (tmp_path / "runs" / "demo" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "mine" / "train_config.json").is_file()


def test_documented_run_directory_layout_matches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _data(tmp_path)
    assert main(["train", *TINY_TRAIN, *TINY_MODEL, "objective=sequence_classification", "train=data/reviews.csv",
                 "--run", "runs/cls", "--no-progress"]) == 0
    run = tmp_path / "runs" / "cls"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_meta.json", "labels.json",
                 "train_config.json", "metrics.jsonl", "metrics.csv", "curves.png", "eval.json",
                 "checkpoints/latest"):
        assert (run / name).exists(), name
        assert f"{Path(name).name}" in DOC.read_text(encoding="utf-8"), name
    state = next((run / "checkpoints").glob("step-*"))
    assert {p.name for p in state.iterdir()} == {"model.safetensors", "config.json", "trainer_state.pt", "meta.json"}


@pytest.mark.parametrize("block", _blocks("toml"))
def test_documented_toml_parses(tmp_path, block):
    from aiayn.training.config import load_run_config

    (tmp_path / "run.toml").write_text(block, encoding="utf-8")
    assert load_run_config(tmp_path / "run.toml").model_overrides["d_model"] == 128
