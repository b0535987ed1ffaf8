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
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from aiayn.cli.main import main
from aiayn.rundir import RunLock
from tests.hardening.conftest import TINY_RUN, truncate

# -- what each case prepares -------------------------------------------------------------------

def write(path, text):
    return lambda scene: Path(scene, path).write_text(text, encoding="utf-8")


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
# directory, never a directory (the README's rule, `aiayn.paths.check_output_file`)
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

# pipes, devices, links and the standard streams (`aiayn.paths.check_input_file`, `aiayn.data.readers`)
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
    Case("translate --num-beams 1000000", ["translate", "--run", "run", "--num-beams", "1000000", "a"], 2,
         r"num_beams 1000000 is more than the target vocabulary \(\d+ tokens\), so the beams could not differ"),
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
               "`--alpha nan`, `--num-beams 1000000`, `lr=inf`, `max_steps=10**23`, `model.d_model=1048576` (4), "
               "`model.max_len=1` against the data, a classifier on one label"),
    "places": ("places aiayn wrote, but not the one the command takes",
               "`--run RUN/checkpoints`, a run that did not finish, `--resume max_steps=8` on a run at step 40"),
}
API_TEXT = ("Python API", "`build_model(dict)`, an ambiguous 2-D mask, `TrainConfig(bf16=\"yes\")`, "
                          "`translate(..., length_penalty=nan)`, `num_beams=True`, `translate(b\"abc\")`")


def readme_table() -> str:
    """The README's "When things go wrong" table of hostile cases, made from the case lists here."""
    from tests.hardening.test_api import API_CASES

    rows = ["| area | cases | for example |", "| --- | --- | --- |"]
    rows += [f"| {AREA_TEXT[area][0]} | {len(cases)} | {AREA_TEXT[area][1]} |" for area, cases in AREAS.items()]
    rows.append(f"| {API_TEXT[0]} | {len(API_CASES)} | {API_TEXT[1]} |")
    return "\n".join(rows)


def test_the_readme_table_is_made_from_these_cases():
    """`python -m tests.hardening.test_cli` prints the table to paste into the README."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert set(AREA_TEXT) == set(AREAS)
    assert readme_table() in text


def test_the_readme_summarises_this_table_and_the_exit_codes():
    from aiayn.cli import errors
    from tests.hardening.test_api import API_CASES

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
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
