"""Hostile input through the CLI: each case gets one line `aiayn CMD: error: ...`, its documented exit code,
and leaves every file that existed before byte-for-byte as it was (README "When things go wrong").

Every case runs in a fresh scene (cwd) holding a trained run (`run/`), a Hugging Face BERT checkpoint
(`bert/`), an aiayn encoder (`enc/`), an earlier export (`export/`), a plain file and files aiayn did
not write. Tiny models only: the whole table takes seconds.
"""

import errno
import io
import json
import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.interop.bert import export_hf
from aiayn.io import save_model
from aiayn.nn.model import build_model
from aiayn.rundir import RunLock
from aiayn.tokenization import train_tokenizer

TINY_RUN = ["task=copy", "task_train=40", "task_valid=4", "task_test=4", "task_max_len=4", "vocab_size=20",
            "max_tokens=100", "threads=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
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


# -- what each case prepares -------------------------------------------------------------------

def write(path, text):
    return lambda scene: Path(scene, path).write_text(text, encoding="utf-8")


def truncate(path, keep=0.5):
    def prepare(scene):
        data = Path(scene, path).read_bytes()
        Path(scene, path).write_bytes(data[: int(len(data) * keep)])
    return prepare


def poison(path, value=float("nan")):
    def prepare(scene):
        state = load_file(Path(scene, path))
        name = sorted(k for k in state if state[k].dim() == 2)[0]
        state[name][0, 0] = value
        save_file(state, Path(scene, path))
    return prepare


def edit_json(path, change):
    def prepare(scene):
        data = json.loads(Path(scene, path).read_text())
        change(data)
        Path(scene, path).write_text(json.dumps(data))
    return prepare


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def pickle_payload(path):
    def prepare(scene):
        torch.save({"weight": Evil()}, Path(scene, path))
    return prepare


def bin_only_bert(scene):
    (scene / "bert" / "model.safetensors").unlink()
    torch.save({"x": Evil()}, scene / "bert" / "pytorch_model.bin")


def full_disk(monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", fsync)


def read_only(monkeypatch):
    def fsync(fd):
        raise OSError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(os, "fsync", fsync)


def partial_then_full_disk(monkeypatch):
    def save(handle, array, *args, **kwargs):
        handle.write(b"\x93NUMPY partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "save", save)


def no_network(monkeypatch):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("a local-looking path went to the network")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


HELD: list = []  # locks a case holds, released after it


def locked(scene):
    HELD.append(RunLock(scene / "run").acquire())  # as another process would: a separate open file holds it


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


# directories the command did not write
DIRECTORIES = [
    Case("train --run '' (the current directory)", ["train", "task=copy", "--run", ""], 2, r"--run is empty"),
    Case("train --run . holding the user's files", ["train", "task=copy", "--run", "."], 2,
         r"\. holds files aiayn did not write \(\w+, [\w.]+, \w+ and \d+ more\); training would write .*--force"),
    Case("train --run at a BERT checkpoint", ["train", "task=copy", "--run", "bert"], 2,
         r"bert holds a Hugging Face checkpoint \(config.json names model_type 'bert'\)"),
    Case("train --run at an aiayn model", ["train", "task=copy", "--run", "enc"], 2, r"enc holds an aiayn model"),
    Case("train --run at an export", ["train", "task=copy", "--run", "export"], 2, r"export holds an aiayn export"),
    Case("train --run naming a file", ["train", "task=copy", "--run", "notes.txt"], 2,
         r"notes.txt is a file, not a directory"),
    Case("train --run at a run without --resume", ["train", "task=copy", "--run", "run"], 2,
         r"run already holds a run; pass --resume"),
    Case("train --resume where no run is", ["train", "--run", "data", "--resume"], 2,
         r"data is not a training run: train_config.json is missing"),
    Case("train --resume with a new model size", ["train", "--run", "run", "--resume", "model.d_model=32"], 2,
         r"--resume keeps the run's model; drop model.d_model=32"),
    Case("export --out at a trained run", ["export", "--model", "enc", "--out", "run"], 2,
         r"run holds an aiayn training run \(train_config.json\); the export would replace.*--force"),
    Case("export --out at a BERT checkpoint", ["export", "--model", "enc", "--out", "bert"], 2,
         r"bert holds a Hugging Face checkpoint"),
    Case("export --out naming a file", ["export", "--model", "enc", "--out", "notes.txt"], 2, r"is a file"),
    Case("export --out ''", ["export", "--model", "enc", "--out", ""], 2, r"--out is empty"),
    Case("second train on a locked run", ["train", "--run", "run", "--resume"], 5,
         r"run is in use: process \d+ is training in it", prepare=locked),
]

# configs, from the command line, TOML and JSON alike
CONFIGS = [
    Case("task=numbers with train=good.tsv", ["train", "task=numbers", "train=good.tsv", "--run", "new"], 2,
         r"task=numbers makes its own data but train=good.tsv names files too"),
    Case("JSON config: a string where a bool belongs", ["train", "c.json", "--run", "new"], 2,
         r"c.json: training key shared_vocab must be true or false, got 'false'",
         prepare=write("c.json", '{"task": "copy", "shared_vocab": "false"}')),
    Case("JSON config: a list, not an object", ["train", "c.json", "--run", "new"], 2,
         r"c.json: expected an object of training keys", prepare=write("c.json", "[1, 2]")),
    Case("JSON config: model is not a table", ["train", "c.json", "--run", "new"], 2,
         r"c.json: 'model' must be a table", prepare=write("c.json", '{"task": "copy", "model": 5}')),
    Case("JSON config: a model value of the wrong type", ["train", "c.json", "--run", "new"], 2,
         r"c.json: model key d_model|c.json: d_model must be a positive integer, got '16'",
         prepare=write("c.json", '{"task": "copy", "model": {"d_model": "16"}}')),
    Case("JSON config: invalid JSON", ["train", "c.json", "--run", "new"], 2, r"c.json:1: invalid JSON",
         prepare=write("c.json", '{"task": ')),
    Case("TOML config: a string where an integer belongs", ["train", "c.toml", "--run", "new"], 2,
         r"c.toml: training key epochs must be an integer, got '3'",
         prepare=write("c.toml", 'task = "copy"\nepochs = "3"\n')),
    Case("CLI override of the wrong type", ["train", "task=copy", "lowercase=perhaps", "--run", "new"], 2,
         r"lowercase expects true or false, got 'perhaps'"),
    Case("unknown config key", ["train", "task=copy", "epochz=3", "--run", "new"], 2, r"unknown config key 'epochz'"),
    Case("train_config.json damaged", ["eval", "--run", "run"], 2, r"run/train_config.json:1: invalid JSON",
         prepare=write("run/train_config.json", "{")),
    Case("a config file that is a directory", ["train", "data", "--run", "new"], 2,
         r"config file data is a directory; give a .toml or .json file"),
    Case("resume: train_config.json with a wrong type", ["train", "--run", "run", "--resume"], 2,
         r"run/train_config.json: training key bf16 must be true or false, got 'no'",
         prepare=edit_json("run/train_config.json", lambda c: c.update(bf16="no"))),
]

# data files and text inputs
DATA = [
    Case("train= a directory", ["train", "train=data", "--run", "new"], 2,
         r"data file data is a directory; give a file"),
    Case("train= a missing file", ["train", "train=nope.tsv", "--run", "new"], 2, r"data file nope.tsv does not exist"),
    Case("a malformed TSV row", ["train", "train=bad.tsv", "--run", "new"], 2,
         r"bad.tsv:2: expected 2 tab-separated columns", prepare=write("bad.tsv", "a\tb\nonly one\n")),
    Case("data that is not UTF-8", ["train", "train=latin.tsv", "--run", "new"], 2, r"latin.tsv: not UTF-8 text",
         prepare=lambda s: Path(s, "latin.tsv").write_bytes("caf\xe9\tx\n".encode("latin-1"))),
    Case("eval --data a directory", ["eval", "--run", "run", "--data", "data"], 2, r"data file data is a directory"),
    Case("params --config a directory", ["params", "--config", "data"], 2, r"data: Is a directory"),
    Case("translate --input a directory", ["translate", "--run", "run", "--input", "data"], 2,
         r"input file data is a directory"),
    Case("search --corpus a directory", ["search", "--model", "enc", "--corpus", "data", "q"], 2,
         r"corpus file data is a directory"),
    Case("embed -o a directory", ["embed", "--model", "enc", "x", "-o", "data"], 2, r"--output data is a directory"),
    Case("translate --show-attention a directory", ["translate", "--run", "run", "hi", "--show-attention", "data"],
         2, r"--show-attention data is a directory; give a .png file name"),
]

# models, checkpoints, tokenizers
MODELS = [
    Case("truncated model.safetensors", ["translate", "--run", "run", "hello"], 2,
         r"run/model.safetensors is not a complete safetensors file", prepare=truncate("run/model.safetensors")),
    Case("empty model.safetensors", ["translate", "--run", "run", "hello"], 2,
         r"run/model.safetensors is empty \(0 bytes\)", prepare=truncate("run/model.safetensors", 0)),
    Case("a NaN weight", ["translate", "--run", "run", "hello"], 2,
         r"run/model.safetensors: non-finite weights \(.* has 1 NaN and 0 Inf values\)",
         prepare=poison("run/model.safetensors")),
    Case("an Inf weight, eval", ["eval", "--run", "run"], 2, r"has 0 NaN and 1 Inf values",
         prepare=poison("run/model.safetensors", float("inf"))),
    Case("config.json missing a key", ["translate", "--run", "run", "hello"], 2,
         r"run/config.json lacks pe_layout; a saved model names every setting",
         prepare=edit_json("run/config.json", lambda c: c.pop("pe_layout"))),
    Case("config.json: a string where a bool belongs", ["translate", "--run", "run", "hello"], 2,
         r"run/config.json: norm_first must be true or false, got 'false'",
         prepare=edit_json("run/config.json", lambda c: c.update(norm_first="false"))),
    Case("config.json of another size than the weights", ["translate", "--run", "run", "hello"], 2,
         r"model.safetensors does not fit the model of its config: .* is \(\d+, 16\) in the file but \(\d+, 32\)",
         prepare=edit_json("run/config.json", lambda c: c.update(d_model=32))),
    Case("corrupt tokenizer.json", ["translate", "--run", "run", "hello"], 2,
         r"run/tokenizer.json: not a readable tokenizer file", prepare=truncate("run/tokenizer.json")),
    Case("corrupt tokenizer_meta.json", ["translate", "--run", "run", "hello"], 2,
         r"run/tokenizer_meta.json: not valid JSON", prepare=write("run/tokenizer_meta.json", "{")),
    Case("trace --run at a BERT checkpoint", ["trace", "--run", "bert"], 2,
         r"bert holds a Hugging Face checkpoint \(model_type 'bert'\), not an aiayn model"),
    Case("BERT: truncated model.safetensors", ["embed", "--model", "bert", "hello"], 2,
         r"bert/model.safetensors is not a complete safetensors file", prepare=truncate("bert/model.safetensors")),
    Case("BERT: corrupt tokenizer.json", ["embed", "--model", "bert", "hello"], 2,
         r"bert/tokenizer.json: not a readable tokenizer file", prepare=write("bert/tokenizer.json", "{nope")),
    Case("BERT: config.json missing sizes", ["embed", "--model", "bert", "hello"], 2,
         r"bert/config.json: the BERT config lacks hidden_size",
         prepare=edit_json("bert/config.json", lambda c: c.pop("hidden_size"))),
    Case("BERT: a pickle .bin with code in it", ["embed", "--model", "bert", "hello"], 2,
         r"pytorch_model.bin: refused: this pickle holds Python objects besides tensors", prepare=bin_only_bert),
    Case("resume: every checkpoint damaged", ["train", "--run", "run", "--resume"], 2,
         r"no intact checkpoint in run/checkpoints: step-00000002: .*; step-00000001: .*refused",
         prepare=lambda s: (truncate("run/checkpoints/step-00000002/model.safetensors")(s),
                            pickle_payload("run/checkpoints/step-00000001/trainer_state.pt")(s))),
    Case("eval --checkpoint that does not exist", ["eval", "--run", "run", "--checkpoint", "step-9"], 2,
         r"checkpoint step-9 not found"),
    Case("a local-looking --model path that does not exist", ["embed", "--model", "./typo/minilm", "x"], 2,
         r"./typo/minilm: no such checkpoint directory", patch=no_network),
    Case("a --model path whose folder exists", ["embed", "--model", "data/minilm", "x"], 2,
         r"data/minilm: no such checkpoint directory", patch=no_network),
    Case("eval --checkpoint damaged", ["eval", "--run", "run", "--checkpoint", "step-00000001"], 2,
         r"step-00000001/model.safetensors is not a complete safetensors file",
         prepare=truncate("run/checkpoints/step-00000001/model.safetensors", 0.9)),
    Case("ONNX export of an encoder-decoder", ["export", "--run", "run", "--onnx", "--out", "new"], 2,
         r"the ONNX export takes encoders; a translator exports to Hugging Face Marian"),
    Case("CTranslate2 export of an encoder", ["export", "--model", "enc", "--ctranslate2", "--out", "new"], 2,
         r"the CTranslate2 export takes translators"),
    Case("translate with an encoder-only model", ["translate", "--run", "enc", "hi"], 2,
         r"enc holds a model without a decoder \(encoder-only\); translate needs an encoder-decoder"),
    Case("--init-from a file", ["train", "task=compare", "objective=sequence_classification", "--init-from",
                                "notes.txt", "--run", "new"], 2, r"notes.txt is not a checkpoint directory"),
]

# arguments
ARGUMENTS = [
    Case("--min-len above --max-new-tokens", ["translate", "--run", "run", "hi", "--min-len", "5",
                                               "--max-new-tokens", "3"], 2, r"min_len 5 is above max_new_tokens 3"),
    Case("--min-len above --max-len", ["translate", "--run", "run", "hi", "--min-len", "5", "--max-len", "3"], 2,
         r"min_len 5 is above max_len 3"),  # the old spelling, named as the user spelled it
    Case("search --index a file aiayn did not write", ["search", "--model", "enc", "--corpus", "good.tsv",
                                                       "--index", "notes.txt", "q"], 2,
         r"notes.txt: not an aiayn search index .*left as it is"),
    Case("an unknown option", ["trace", "--run", "run", "--bogus"], 2,
         r"unrecognized arguments: --bogus \(see aiayn trace --help\)"),
    Case("a missing required option", ["train", "task=copy"], 2, r"the following arguments are required: --run"),
    Case("a value argparse cannot read", ["trace", "--seed", "x"], 2, r"argument --seed: invalid int value: 'x'"),
    Case("a choice argparse does not know", ["eval", "--run", "run", "--split", "dev"], 2,
         r"argument --split: invalid choice: 'dev'"),
]

# the system refuses, numbers go bad
SYSTEM = [
    Case("embed -o out.npy on a full disk", ["embed", "--model", "enc", "x", "-o", "notes.npy"], 4,
         r"notes.npy: No space left on device; free some disk space", patch=partial_then_full_disk,
         prepare=lambda s: np.save(Path(s, "notes.npy"), np.ones(3))),
    Case("search saving its index on a full disk", ["search", "--model", "enc", "--corpus", "good.tsv", "q"], 4,
         r"good.tsv.aiayn-index.npz: No space left on device", patch=full_disk),
    Case("training on a full disk", ["train", *TINY_RUN, "max_steps=1", "--run", "new", "--no-progress"], 4,
         r"new/train_config.json: No space left on device", patch=full_disk, new_files=True),
    Case("permission denied", ["export", "--model", "enc", "--out", "export"], 4,
         r"export/aiayn_export.json: Permission denied; check the file's permissions", patch=read_only),
    Case("non-finite evaluation loss", ["eval", "--run", "run"], 3, r"the loss on test is nan \(not finite\)",
         prepare=lambda s: save_file({k: v * 1e30 if v.dim() > 1 else v
                                      for k, v in load_file(Path(s, "run/model.safetensors")).items()},
                                     Path(s, "run/model.safetensors"))),
]

def symlink(path, target):
    return lambda scene: os.symlink(target, Path(scene, path))


def link_loop(scene):
    os.symlink("loop-b", scene / "loop-a")
    os.symlink("loop-a", scene / "loop-b")


def stdin_bytes(data):
    def patch(monkeypatch):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    return patch


def stdin_closed(monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)  # what Python makes of `<&-`


def interrupted_run(scene):
    for name in ("config.json", "model.safetensors", "eval.json"):
        (scene / "run" / name).unlink()


def copy_run(name):
    return lambda scene: shutil.copytree(scene / "run", scene / name)


def one_label(scene):
    (scene / "one.csv").write_text("text,label\n" + "".join(f"w{i} x,pos\n" for i in range(12)), encoding="utf-8")


# output paths: an explicit output file may be replaced; never an input, never a file inside a run or model
# directory, never a directory (the README's rule, `aiayn.rundir.check_output_file`)
OUTPUTS = [
    Case("translate --output naming its own --input", ["translate", "--run", "run", "--input", "notes.txt",
                                                       "--output", "notes.txt"], 2,
         r"--output notes.txt is the input --input notes.txt: the output would replace it; choose another --output"),
    Case("embed -o naming its own -i", ["embed", "--model", "enc", "-i", "t.jsonl", "-o", "t.jsonl"], 2,
         r"--output t.jsonl is the input --input t.jsonl", prepare=write("t.jsonl", "one\ntwo\n")),
    Case("translate -o another run's weights", ["translate", "--run", "run", "-o", "other/model.safetensors", "a b"],
         2, r"--output other/model.safetensors is inside other, which holds an aiayn training run .*choose an --output "
            r"file outside it", prepare=copy_run("other")),
    Case("translate -o inside its own --run", ["translate", "--run", "run", "-o", "run/checkpoints/out.txt", "a b"],
         2, r"--output run/checkpoints/out.txt is inside the input --run run"),
    Case("embed -o inside a BERT checkpoint", ["embed", "--model", "enc", "x", "-o", "bert/v.npy"], 2,
         r"--output bert/v.npy is inside .*bert, which holds a Hugging Face checkpoint"),
    Case("translate --show-attention inside the run", ["translate", "--run", "run", "a", "--show-attention",
                                                       "run/attention.png"], 2,
         r"--show-attention run/attention.png is inside the input --run run"),
    Case("translate --show-attention with an unknown extension", ["translate", "--run", "run", "a",
                                                                  "--show-attention", "map.bmpx"], 2,
         r"--show-attention must end in .*\.pdf.*\.png.* or \.webp, got 'map.bmpx'"),
    Case("search --index naming the corpus", ["search", "--model", "enc", "--corpus", "good.tsv", "--index",
                                              "good.tsv", "q"], 2, r"--index good.tsv is the input --corpus good.tsv"),
    Case("search --index at a text file", ["search", "--model", "enc", "--corpus", "good.tsv", "--index",
                                           "notes.txt", "q"], 2,
         r"notes.txt: not an aiayn search index \(an .npz archive of texts, vectors and a digest\); it is left as "
         r"it is"),
    Case("corpus --out holding the user's train.tsv", ["corpus", "--out", "mine"], 2,
         r"mine holds files aiayn did not write \(train.tsv\); the corpus would replace files there: choose a new "
         r"--out directory", prepare=lambda s: (Path(s, "mine").mkdir(), write("mine/train.tsv", "my\town\n")(s))),
    Case("corpus --out naming a file", ["corpus", "--out", "notes.txt"], 2,
         r"notes.txt is a file, not a directory: give --out a directory"),
    Case("export --quantization unknown leaves no directory", ["export", "--model", "run", "--ctranslate2",
                                                              "--quantization", "int3", "--out", "ct2"], 2,
         r"--quantization must be one of int8, .*got 'int3'"),
]

# pipes, devices, links and the standard streams (`aiayn.rundir.check_input_file`, `aiayn.data.readers`)
STREAMS = [
    Case("--input a character device", ["translate", "--run", "run", "--input", "/dev/zero"], 2,
         r"input file /dev/zero is a character device, not a regular file; give a regular file"),
    Case("--input a symbolic link loop", ["translate", "--run", "run", "--input", "loop-a"], 2,
         r"input file loop-a is a symbolic link loop, not a regular file", prepare=link_loop),
    Case("train= a link to a missing file", ["train", "train=gone.tsv", "--run", "new"], 2,
         r"data file gone.tsv is a link to a missing file", prepare=symlink("gone.tsv", "nowhere.tsv")),
    Case("model.safetensors a directory", ["translate", "--run", "run", "a"], 2,
         r"run/model.safetensors is a directory; a safetensors weights file belongs there",
         prepare=lambda s: ((s / "run/model.safetensors").unlink(), (s / "run/model.safetensors").mkdir())),
    Case("model.safetensors a link to /dev/zero", ["translate", "--run", "run", "a"], 2,
         r"weights file run/model.safetensors is a character device, not a regular file",
         prepare=lambda s: ((s / "run/model.safetensors").unlink(), symlink("run/model.safetensors", "/dev/zero")(s))),
    Case("tokenizer.json a link to /dev/zero", ["translate", "--run", "run", "a"], 2,
         r"tokenizer file run/tokenizer.json is a character device, not a regular file",
         prepare=lambda s: ((s / "run/tokenizer.json").unlink(), symlink("run/tokenizer.json", "/dev/zero")(s))),
    Case("config.json a symbolic link loop", ["translate", "--run", "run", "a"], 2,
         r"model config run/config.json is a symbolic link loop",
         prepare=lambda s: ((s / "run/config.json").unlink(), symlink("run/config.json", "config.json")(s))),
    Case("stdin closed", ["translate", "--run", "run"], 2,
         r"stdin is closed: give the texts as arguments or with --input FILE", patch=stdin_closed),
    Case("embed with stdin closed", ["embed", "--model", "enc"], 2, r"stdin is closed", patch=stdin_closed),
    Case("Latin-1 text on stdin", ["translate", "--run", "run"], 2,
         r"stdin: not UTF-8 text \(invalid continuation byte at byte 3\)", patch=stdin_bytes(b"caf\xe9 au lait\n")),
    Case("binary bytes on stdin", ["embed", "--model", "enc"], 2,
         r"stdin: not UTF-8 text \(invalid start byte at byte 1\)", patch=stdin_bytes(b"\x00\xff\xfe\x00")),
]

# numbers and values: finite, in range, the right type, checked before any work starts
VALUES = [
    Case("corpus --valid -1", ["corpus", "--valid", "-1", "--out", "c"], 2, r"--valid must be at least 0, got -1"),
    Case("translate --alpha nan", ["translate", "--run", "run", "--alpha", "nan", "a"], 2,
         r"--alpha must be a finite number, got nan"),
    Case("translate --alpha inf", ["translate", "--run", "run", "--alpha", "inf", "a"], 2,
         r"--alpha must be a finite number, got inf"),
    Case("translate --top-p 0", ["translate", "--run", "run", "--sample", "--top-p", "0", "a"], 2,
         r"--top-p must be above 0, got 0"),
    Case("translate --beam 1000000", ["translate", "--run", "run", "--beam", "1000000", "a"], 2,
         r"beam_size 1000000 is more than the target vocabulary \(\d+ tokens\), so the beams could not differ"),
    Case("translate --attention-layer 99, before translating", ["translate", "--run", "run", "a", "--show-attention",
                                                                 "map.png", "--attention-layer", "99"], 2,
         r"--attention-layer 99 is outside 1..1 \(the model has 1 decoder layer\)"),
    Case("eval --examples -5", ["eval", "--run", "run", "--examples", "-5"], 2,
         r"--examples must be at least 0, got -5"),
    Case("search an empty query", ["search", "--model", "enc", "--corpus", "good.tsv", ""], 2,
         r"query 1 is empty: give the text to search for"),
    Case("embed --max-length 0", ["embed", "--model", "enc", "--max-length", "0", "x"], 2,
         r"--max-length must be at least 3, got 0"),
    Case("train lr=nan", ["train", *TINY_RUN, "lr=nan", "--run", "new"], 2,
         r"training key lr must be a finite number, got nan"),
    Case("train lr=inf", ["train", *TINY_RUN, "lr=inf", "--run", "new"], 2,
         r"training key lr must be a finite number, got inf"),
    Case("train max_steps=10**23", ["train", *TINY_RUN, f"max_steps={10**23}", "--run", "new"], 2,
         r"training key max_steps must be at most 9,223,372,036,854,775,807 in size"),
    Case("train model.layer_norm_eps=nan", ["train", *TINY_RUN, "model.layer_norm_eps=nan", "--run", "new"], 2,
         r"layer_norm_eps must be a finite number, got nan"),
    Case("train model.d_model=1048576 (out of memory)", ["train", *TINY_RUN, "model.d_model=1048576", "--run", "new",
                                                         "--no-progress"], 4,
         r"training with batches of max_tokens=100 needs about [\d,.]+ GiB of memory, more than the [\d,.]+ GiB "
         r"available \(.*d_model 1,048,576.*\): make max_tokens or the layers \(n_encoder_layers, n_decoder_layers, "
         r"d_model, d_ff\) smaller"),
    Case("train model.max_len=10**11 (out of memory)", ["train", *TINY_RUN, f"model.max_len={10**11}", "--run",
                                                        "new", "--no-progress"], 4,
         r"training with batches of max_tokens=100 needs about [\d,.]+ GiB of memory.*: make max_tokens or max_len "
         r"smaller"),
    Case("train model.max_len=1, checked against the data", ["train", *TINY_RUN, "model.max_len=1", "--run", "new",
                                                              "--no-progress"], 2,
         r"model.max_len=1 is shorter than the longest example \(\d+ tokens with its special tokens\)"),
    Case("train vocab_size=1", ["train", *TINY_RUN, "vocab_size=1", "--run", "new", "--no-progress"], 2,
         r"vocab_size 1 is too small for this text: its 4 special tokens and \d+ distinct characters need at least"),
    Case("a classifier on one label", ["train", "train=one.csv", "objective=sequence_classification", "threads=1",
                                       "--run", "new", "--no-progress"], 2,
         r"the training data has one label \('pos'\): there is nothing to tell apart", prepare=one_label),
]

# places: a directory aiayn wrote, but not the one the command takes
PLACES = [
    Case("translate --run RUN/checkpoints", ["translate", "--run", "run/checkpoints", "a"], 2,
         r"run/checkpoints holds the checkpoints of the run run, not a model: give the run directory run"),
    Case("train --run RUN/checkpoints", ["train", "task=copy", "--run", "run/checkpoints"], 2,
         r"run/checkpoints holds the checkpoints of the run run: give --run run \(with --resume to continue it\)"),
    Case("train --resume at RUN/checkpoints", ["train", "--run", "run/checkpoints", "--resume"], 2,
         r"run/checkpoints holds the checkpoints of the run run"),
    Case("translate an interrupted run", ["translate", "--run", "run", "a"], 2,
         r"run: training did not finish \(no final config.json yet\): continue it with aiayn train --run run --resume, "
         r"or use a checkpoint", prepare=interrupted_run),
    Case("train --run inside another run", ["train", "task=copy", "--run", "run/nested"], 2,
         r"run/nested is inside run, which holds an aiayn training run \(train_config.json\): choose a --run "
         r"directory outside it"),
    Case("train --resume max_steps below the run's step", ["train", "--run", "run", "--resume", "max_steps=1"], 2,
         r"run/checkpoints/step-00000002 is at step 2, past max_steps=1: nothing is left to train"),
]

AREAS = {"directories": DIRECTORIES, "configs": CONFIGS, "data": DATA, "models": MODELS,
         "arguments": ARGUMENTS, "system": SYSTEM, "outputs": OUTPUTS, "streams": STREAMS, "values": VALUES,
         "places": PLACES}
CASES = [case for cases in AREAS.values() for case in cases]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_line_and_an_exit_code_and_loses_nothing(case, scene, frozen, monkeypatch, capsys):
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


def test_the_table_covers_every_exit_code():
    assert {c.code for c in CASES} == {2, 3, 4, 5}
    assert len(CASES) >= 50


# -- behaviours that succeed where they used to go wrong --------------------------------------------

def test_resume_falls_back_to_the_newest_intact_checkpoint_and_says_which(scene, frozen, capsys):
    truncate("run/checkpoints/step-00000002/model.safetensors")(scene)
    kept = frozen(scene / "run" / "checkpoints" / "step-00000001")
    assert main(["train", "--run", "run", "--resume", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "skipped a damaged checkpoint: step-00000002: " in out and "not a complete safetensors file" in out
    assert "resumed from run/checkpoints/step-00000001 (step 1," in out
    assert "trained 2 steps" in out
    kept()


def test_train_force_writes_beside_foreign_files_and_keeps_them(scene, frozen, capsys):
    check = frozen(scene)
    assert main(["train", *TINY_RUN, "max_steps=1", "--run", ".", "--force", "--no-progress"]) == 0
    # config.json and metrics.csv are aiayn names: forced, the run replaces them; the rest is untouched
    check(ignore=("config.json", "metrics.csv"))
    assert json.loads((scene / "train_config.json").read_text())["task"] == "copy"


def test_export_may_replace_its_own_earlier_export(scene, capsys):
    assert main(["export", "--model", "enc", "--out", "export"]) == 0
    assert json.loads((scene / "export" / "aiayn_export.json").read_text()) == {"format": "hf"}
    assert main(["export", "--model", "enc", "--out", "bert", "--force"]) == 0  # forced: the user asked


def test_debug_prints_the_traceback_too(scene, capsys):
    assert main(["translate", "--run", "missing", "hi", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1] == "aiayn translate: error: missing is not an aiayn model directory " \
                                           "(no such directory)"


def test_a_bug_is_exit_code_1_with_one_line(scene, monkeypatch, capsys):
    def broken(args):
        raise TypeError("unsupported operand")
    monkeypatch.setattr("aiayn.cli.core.cmd_params", broken)
    assert main(["params"]) == 1
    assert capsys.readouterr().err == ("aiayn params: error: internal error: TypeError: unsupported operand "
                                       "(rerun with --debug for the traceback)\n")


def test_pipes_are_read_as_files_are(scene, frozen, capsys):
    """`--input <(cmd)` (a pipe under /dev/fd) and a FIFO are streams: read once, like a file."""
    check = frozen(scene)
    expected = main(["translate", "--run", "run", "--beam", "1", "--max-len", "2", "a b", "c"]), capsys.readouterr().out
    read, written = os.pipe()
    os.write(written, b"a b\nc\n")
    os.close(written)
    try:
        code = main(["translate", "--run", "run", "--beam", "1", "--max-len", "2", "--input", f"/dev/fd/{read}"])
    finally:
        os.close(read)
    assert (code, capsys.readouterr().out) == expected
    os.mkfifo(scene / "fifo")
    writer = threading.Thread(target=lambda: Path(scene, "fifo").write_bytes(b"a b\nc\n"))
    writer.start()
    code = main(["translate", "--run", "run", "--beam", "1", "--max-len", "2", "--input", "fifo"])
    writer.join()
    assert (code, capsys.readouterr().out) == expected
    check(new_files=False, ignore=("fifo",))


def test_eval_data_for_another_kind_of_run_says_so(classification_run, tmp_path, frozen, capsys):
    (tmp_path / "pairs.tsv").write_text("hello\thallo\ngood morning\tguten Morgen\n", encoding="utf-8")
    check = frozen(classification_run)
    assert main(["eval", "--run", str(classification_run), "--data", str(tmp_path / "pairs.tsv")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "data split: none of its labels ('guten Morgen', 'hallo') is one of the run's (neg, pos): is this data for "
        "another kind of run? (this one is sequence_classification)")
    check(new_files=False)


def test_a_checkpoint_translates_with_its_runs_tokenizer(scene, capsys):
    assert main(["translate", "--run", "run/checkpoints/step-00000001", "--beam", "1", "--max-len", "2", "a"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_an_explicit_output_file_may_be_replaced(scene, capsys):
    assert main(["translate", "--run", "run", "--beam", "1", "--max-len", "2", "a", "-o", "notes.txt"]) == 0
    assert Path(scene, "notes.txt").read_text() != "a plain file\n"


def test_text_inputs_keep_odd_line_breaks_and_drop_a_bom(scene, capsys):
    lines = ["\ufeffone two", "three\x0cfour", "five\u2028six", "seven\x85eight"]
    Path(scene, "in.txt").write_text("\n".join(lines) + "\r\n", encoding="utf-8")
    assert main(["translate", "--run", "run", "--input", "in.txt", "--beam", "1", "--max-len", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4  # one output line per input line
    assert main(["embed", "--model", "enc", "--input", "in.txt"]) == 0
    texts = [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()]
    assert texts == ["one two", "three\x0cfour", "five\u2028six", "seven\x85eight"]


def test_a_disk_that_fills_mid_run_keeps_the_last_checkpoint_and_says_how_to_resume(scene, monkeypatch, capsys):
    real_save, calls = torch.save, []

    def save(obj, handle, *args, **kwargs):  # the trainer state of the second checkpoint hits a full disk
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, handle, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code = main(["train", *TINY_RUN, "max_steps=3", "save_every=1", "--run", "new", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 4
    assert err == ("aiayn train: error: new/checkpoints/step-00000002: No space left on device; free some disk "
                   "space and run it again; new/checkpoints/step-00000001 is intact: continue with aiayn train "
                   "--run new --resume")
    assert sorted(p.name for p in (scene / "new" / "checkpoints").iterdir()) == ["latest", "step-00000001"]
    monkeypatch.setattr(torch, "save", real_save)
    assert main(["train", "--run", "new", "--resume", "--no-progress"]) == 0
    assert "resumed from new/checkpoints/step-00000001" in capsys.readouterr().out


# What the README's table says of each area: (the area in words, starting with its key; an example).
AREA_TEXT = {
    "directories": ("directories the command did not write",
                    "`--run \"\"`, `--run` at a BERT checkpoint, `export --out` at a run, a second `train` on a locked "
                    "run (5)"),
    "configs": ("configs, from CLI, TOML and JSON alike",
                '`"shared_vocab": "false"` in JSON, a list instead of an object, `task=numbers train=good.tsv`'),
    "data": ("data and text inputs", "a directory where a file belongs, a malformed TSV row, text that is not UTF-8"),
    "models": ("models, checkpoints, tokenizers",
               "truncated or empty `model.safetensors`, a NaN weight, `config.json` missing a key, a pickle `.bin`, "
               "every checkpoint damaged"),
    "arguments": ("arguments", "`--min-len` above `--max-new-tokens`, a local-looking `--model` path (never sent to "
                               "the network)"),
    "system": ("system and numbers", "`embed -o out.npy` on a full disk leaves the old file whole (4), `eval` with a "
                                     "NaN loss (3)"),
    "outputs": ("outputs that would replace what they must not",
                "`translate --input a.txt -o a.txt`, `-o runs/other/model.safetensors`, `corpus --out` at the user's "
                "`train.tsv`, `--quantization int3` (no directory left)"),
    "streams": ("streams, pipes, devices and links",
                "`--input /dev/zero`, a symlink loop, `model.safetensors` a directory or a link to `/dev/zero`, stdin "
                "closed (`<&-`) or Latin-1"),
    "values": ("values (finite, in range, the right type), checked before any work",
               "`--alpha nan`, `--beam 1000000`, `lr=inf`, `max_steps=10**23`, `model.d_model=1048576` (4), "
               "`model.max_len=1` against the data, a classifier on one label"),
    "places": ("places aiayn wrote, but not the one the command takes",
               "`--run RUN/checkpoints`, a run that did not finish, `--resume max_steps=8` on a run at step 40"),
}
API_TEXT = ("Python API", "`build_model(dict)`, an ambiguous 2-D mask, `TrainConfig(bf16=\"yes\")`, "
                          "`translate(..., length_penalty=nan)`, `num_beams=True`, `translate(b\"abc\")`")


def readme_table() -> str:
    """The README's "When things go wrong" table of hostile cases, made from the case lists here."""
    from test_hardening_api import API_CASES

    rows = ["| area | cases | for example |", "| --- | --- | --- |"]
    rows += [f"| {AREA_TEXT[area][0]} | {len(cases)} | {AREA_TEXT[area][1]} |" for area, cases in AREAS.items()]
    rows.append(f"| {API_TEXT[0]} | {len(API_CASES)} | {API_TEXT[1]} |")
    return "\n".join(rows)


def test_the_readme_table_is_made_from_these_cases():
    """`python tests/test_hardening_cli.py` prints the table to paste into the README."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert set(AREA_TEXT) == set(AREAS)
    assert readme_table() in text


def test_the_readme_summarises_this_table_and_the_exit_codes():
    from test_hardening_api import API_CASES

    from aiayn.cli import errors

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text.split("## When things go wrong", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in section.splitlines() if row.startswith("| ")]
    counts = {cells[0].split()[0].strip(","): int(cells[1]) for cells in rows if len(cells) == 3 and cells[1].isdigit()}
    assert counts == {**{area: len(cases) for area, cases in AREAS.items()}, "Python": len(API_CASES)}
    assert f"runs {len(CASES)} hostile cases" in section and f"{len(API_CASES)} through the Python API" in section
    codes = {int(cells[0]) for cells in rows if len(cells) == 2 and cells[0].isdigit()}
    assert codes == {errors.OK, errors.INTERNAL, errors.BAD_INPUT, errors.NON_FINITE, errors.SYSTEM, errors.BUSY,
                     errors.INTERRUPTED}


if __name__ == "__main__":
    print(readme_table())
