"""Exact resume: a run killed with SIGKILL mid-epoch and resumed ends bitwise equal to an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from aiayn.training.checkpoint import list_checkpoints

ARGS = ["dataset=copy", "dataset_train=300", "dataset_valid=20", "dataset_test=20", "dataset_max_len=5",
        "vocab_size=20", "max_tokens=120", "threads=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2",
        "model.n_encoder_layers=1", "model.n_decoder_layers=1", "model.dropout=0.1", "warmup=20",
        "max_steps=12", "save_every=4", "eval_every=3", "log_every=1", "show_examples=0"]

# Runs `aiayn train` and SIGKILLs itself right after optimizer step KILL_AT.
KILLER = """
import os, signal, sys
from aiayn.training.loop import Trainer

def after_step(self):
    if self.step == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)

Trainer.after_step = after_step
from aiayn.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _aiayn(args, env=None):
    return subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_sigkill_then_resume_equals_uninterrupted_bitwise(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = _aiayn(["train", *ARGS, "--run", str(whole), "--no-progress"])
    assert done.returncode == 0, done.stderr

    proc = subprocess.run([sys.executable, "-c", KILLER, "train", *ARGS, "--run", str(killed), "--no-progress"],
                          capture_output=True, text=True, env={**os.environ, "KILL_AT": "10"}, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    # the newest checkpoint is from before the kill: step 8 (save_every) or 9 (a better validation)
    assert [p.name for p in list_checkpoints(killed / "checkpoints")][-1] in ("step-00000008", "step-00000009")
    assert not (killed / "model.safetensors").exists()

    resumed = _aiayn(["train", "--run", str(killed), "--resume", "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout + resumed.stderr
    # every weight tensor bitwise equal (the file header orders tied-weight aliases by hash, so compare tensors)
    resumed_weights = load_file(killed / "model.safetensors")
    whole_weights = load_file(whole / "model.safetensors")
    assert resumed_weights.keys() == whole_weights.keys()
    for name, tensor in whole_weights.items():
        assert torch.equal(resumed_weights[name], tensor), name
    last = Path("checkpoints") / "step-00000012" / "trainer_state.pt"
    assert (killed / last).is_file() and (whole / last).is_file()
    # the metric logs agree too, apart from timing (tokens per second, and time_s: the wall clock of the process)
    def rows(run):
        timing = ("tokens_per_s", "time_s")
        return [{k: v for k, v in json.loads(line).items() if k not in timing}
                for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows(killed) == rows(whole)


def test_ctrl_c_saves_and_resume_finishes(tmp_path):
    run = tmp_path / "run"
    script = KILLER.replace("signal.SIGKILL", "signal.SIGINT")
    proc = subprocess.run([sys.executable, "-c", script, "train", *ARGS, "--run", str(run), "--no-progress"],
                          capture_output=True, text=True, env={**os.environ, "KILL_AT": "6"}, timeout=300)
    assert proc.returncode == 130, proc.stderr
    assert "resume with" in proc.stdout
    assert list_checkpoints(run / "checkpoints")[-1].name == "step-00000006"
    resumed = _aiayn(["train", "--run", str(run), "--resume", "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr
    assert (run / "model.safetensors").is_file()
