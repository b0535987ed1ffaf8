"""Hostile CLI cases about the files and streams a command reads: data files and text inputs, pipes, devices,
links and the standard streams. Each gets one line `aiayn CMD: error: ...`, its exit code, and loses nothing (the
scene and `refused`: tests/hardening/conftest.py)."""

import io
import os
import sys
from pathlib import Path

import pytest

from tests.hardening.conftest import Case, write


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

CASES = [*DATA, *STREAMS]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_line_and_an_exit_code_and_loses_nothing(case, refused):
    refused(case)
