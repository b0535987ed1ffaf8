"""Hostile CLI cases about run directories: a directory the command did not write (the user's files, a BERT
checkpoint, an export, a locked run) and a directory aiayn wrote but not the one the command takes (a run's
checkpoints, a run that did not finish, a run inside a run). Each gets one line `aiayn CMD: error: ...`, its exit code,
and loses nothing (the scene and `refused`: tests/hardening/conftest.py)."""

import pytest

from aiayn.rundir import RunLock
from tests.hardening.conftest import HELD, Case


def locked(scene):
    HELD.append(RunLock(scene / "run").acquire())  # as another process would: a separate open file holds it


def interrupted_run(scene):
    for name in ("config.json", "model.safetensors", "eval.json"):
        (scene / "run" / name).unlink()


# directories the command did not write
DIRECTORIES = [
    Case("train --run '' (the current directory)", ["train", "dataset=copy", "--run", ""], 2, r"--run is empty"),
    Case("train --run . holding the user's files", ["train", "dataset=copy", "--run", "."], 2,
         r"\. holds files aiayn did not write \(\w+, [\w.]+, \w+ and \d+ more\); training would write .*--force"),
    Case("train --run at a BERT checkpoint", ["train", "dataset=copy", "--run", "bert"], 2,
         r"bert holds a Hugging Face checkpoint \(config.json names model_type 'bert'\)"),
    Case("train --run at an aiayn model", ["train", "dataset=copy", "--run", "enc"], 2, r"enc holds an aiayn model"),
    Case("train --run at an export", ["train", "dataset=copy", "--run", "export"], 2, r"export holds an aiayn export"),
    Case("train --force --run at an aiayn model", ["train", "dataset=copy", "--run", "enc", "--force"], 2,
         r"enc holds an aiayn model .*; training never writes into it: choose a new --run directory$"),
    Case("train --force --run at an export", ["train", "dataset=copy", "--run", "export", "--force"], 2,
         r"export holds an aiayn export .*; training never writes into it"),
    Case("train --force --run inside a run", ["train", "dataset=copy", "--run", "run/inner", "--force"], 2,
         r"run/inner is inside run, which holds an aiayn training run"),
    Case("train --run naming a file", ["train", "dataset=copy", "--run", "notes.txt"], 2,
         r"notes.txt is a file, not a directory"),
    Case("train --run at a run without --resume", ["train", "dataset=copy", "--run", "run"], 2,
         r"run already holds a run; pass --resume"),
    Case("train --resume where no run is", ["train", "--run", "data", "--resume"], 2,
         r"data is not a training run: train_config.json is missing"),
    Case("train --resume with a new model size", ["train", "--run", "run", "--resume", "model.d_model=32"], 2,
         r"--resume keeps the run's model; drop model.d_model=32"),
    Case("export --out at a trained run", ["export", "--model", "enc", "--out", "run"], 2,
         r"run holds an aiayn training run \(train_config.json\); the export never replaces it: choose a new --out "
         r"directory$"),
    Case("export --out at a BERT checkpoint", ["export", "--model", "enc", "--out", "bert"], 2,
         r"bert holds a Hugging Face checkpoint"),
    # --force replaces an earlier export or writes beside the user's files, never over a directory it found
    Case("export --force --out at the run it exports", ["export", "--run", "run", "--out", "run", "--force"], 2,
         r"run holds an aiayn training run \(train_config.json\); the export never replaces it: choose a new --out "
         r"directory$"),
    Case("export --onnx --out at an export in another format", ["export", "--model", "enc", "--out", "export",
                                                                  "--onnx", "--force"], 2,
         r"export holds an aiayn export in the hf format; the export in the onnx format would leave its files beside "
         r"the new ones: choose a new --out directory, or delete that one first$"),
    Case("export --force --out RUN/checkpoints", ["export", "--model", "enc", "--out", "run/checkpoints", "--force"],
         2, r"run/checkpoints holds the checkpoints of the run run; the export never replaces it: choose a new --out "
            r"directory$"),
    Case("export --force --out inside a run", ["export", "--model", "enc", "--out", "run/hf", "--force"], 2,
         r"run/hf is inside run, which holds an aiayn training run \(train_config.json\); the export never writes "
         r"there: choose an --out directory outside it$"),
    Case("export --force --out at the model it exports", ["export", "--model", "enc", "--out", "enc", "--force"], 2,
         r"enc holds an aiayn model \(config.json, model.safetensors\); the export never replaces it: choose a new "
         r"--out directory$"),
    Case("export --force --out at a BERT checkpoint", ["export", "--model", "enc", "--out", "bert", "--force"], 2,
         r"bert holds a Hugging Face checkpoint .*; the export never replaces it: choose a new --out directory$"),
    Case("export --force --out inside an export", ["export", "--model", "enc", "--out", "export/onnx", "--force"],
         2, r"export/onnx is inside export, which holds an aiayn export \(aiayn_export.json\); the export never "
            r"writes there: choose an --out directory outside it$"),
    Case("export --out naming a file", ["export", "--model", "enc", "--out", "notes.txt"], 2, r"is a file"),
    Case("export --out ''", ["export", "--model", "enc", "--out", ""], 2, r"--out is empty"),
    Case("second train on a locked run", ["train", "--run", "run", "--resume"], 5,
         r"run is in use: process \d+ is training in it", prepare=locked),
]

# places: a directory aiayn wrote, but not the one the command takes
PLACES = [
    Case("translate --run RUN/checkpoints", ["translate", "--run", "run/checkpoints", "a"], 2,
         r"run/checkpoints holds the checkpoints of the run run, not a model: give the run directory run"),
    Case("translate --run RUN/checkpoints/latest (a pointer)", ["translate", "--run", "run/checkpoints/latest", "a"],
         2, r"run/checkpoints/latest is the run run's pointer to its latest checkpoint \(step-\d+\), not a model: give "
            r"run/checkpoints/step-\d+ \(or aiayn eval --run run --checkpoint step-\d+\), or the run run"),
    Case("export --run RUN/checkpoints/latest", ["export", "--run", "run/checkpoints/latest", "--out", "x"],
         2, r"run/checkpoints/latest is the run run's pointer to its latest checkpoint \(step-\d+\), not a model"),
    Case("translate --run a file", ["translate", "--run", "notes.txt", "a"], 2,
         r"notes.txt is not an aiayn model directory \(a file, not a directory\)"),
    Case("train --run RUN/checkpoints", ["train", "dataset=copy", "--run", "run/checkpoints"], 2,
         r"run/checkpoints holds the checkpoints of the run run: give --run run \(with --resume to continue it\)"),
    Case("train --resume at RUN/checkpoints", ["train", "--run", "run/checkpoints", "--resume"], 2,
         r"run/checkpoints holds the checkpoints of the run run"),
    Case("translate an interrupted run", ["translate", "--run", "run", "a"], 2,
         r"run: training did not finish \(no final config.json yet\): continue it with aiayn train --run run --resume, "
         r"or use a checkpoint", prepare=interrupted_run),
    Case("train --run inside another run", ["train", "dataset=copy", "--run", "run/nested"], 2,
         r"run/nested is inside run, which holds an aiayn training run \(train_config.json\): choose a --run "
         r"directory outside it"),
    Case("train --resume max_steps below the run's step", ["train", "--run", "run", "--resume", "max_steps=1"], 2,
         r"run/checkpoints/step-00000002 is at step 2, past max_steps=1: nothing is left to train"),
]

CASES = [*DIRECTORIES, *PLACES]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_line_and_an_exit_code_and_loses_nothing(case, refused):
    refused(case)
