"""Hostile CLI cases about what a command writes: an output that would replace what it must not (an input, a file
inside a run or model directory, a directory), and a system that refuses (a full disk, permission denied) or numbers
that go bad. Each gets one line `aiayn CMD: error: ...`, its exit code, and loses nothing (the scene and `refused`:
tests/hardening/conftest.py)."""

import errno
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from tests.hardening.conftest import TINY_RUN, Case, write


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


def read_only_folder(monkeypatch):
    def temporary_file(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)


def copy_run(name):
    return lambda scene: shutil.copytree(scene / "run", scene / name)


GUIDE = "# Speed\n<!-- bench-table: encoder -->\n| a rendered row |\n<!-- /bench-table -->\n"


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
    Case("translate -o under a file", ["translate", "--run", "run", "-o", "notes.txt/out.txt", "a b"], 2,
         r"--output notes.txt/out.txt: notes.txt is not a folder; choose an --output file in a folder"),
    Case("translate -o in a folder that takes no file", ["translate", "--run", "run", "-o", "new/out.txt", "a b"], 2,
         r"--output new/out.txt: no file can be written in \. \(Read-only file system\); choose an --output file in "
         r"a folder you can write", patch=read_only_folder),
    Case("translate -o empty", ["translate", "--run", "run", "-o", "", "a b"], 2, r"--output is empty; name a file"),
    Case("translate --show-attention empty", ["translate", "--run", "run", "a", "--show-attention", ""], 2,
         r"--show-attention is empty; name a file"),
    Case("embed -o empty", ["embed", "--model", "enc", "x", "-o", ""], 2, r"--output is empty; name a file"),
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
    Case("bench report --update from an empty folder", ["bench", "report", "data", "--update", "guide.md"], 2,
         r"data holds no benchmark records \(\*\.json\): give the folder", prepare=write("guide.md", GUIDE)),
    Case("bench report --update from a missing folder", ["bench", "report", "gone", "--update", "guide.md"], 2,
         r"gone does not exist: give the folder of benchmark records", prepare=write("guide.md", GUIDE)),
    Case("export --quantization unknown leaves no directory", ["export", "--model", "run", "--ctranslate2",
                                                              "--quantization", "int3", "--out", "ct2"], 2,
         r"--quantization must be one of int8, .*got 'int3'"),
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

CASES = [*OUTPUTS, *SYSTEM]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_line_and_an_exit_code_and_loses_nothing(case, refused):
    refused(case)
