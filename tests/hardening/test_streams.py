"""Output that cannot be taken and signals a terminal or supervisor sends, with real processes: a reader that went
away ends a command quietly, a full or closed stdout is one line naming stdout (exit 4), an output option never
names a device, and SIGHUP / SIGQUIT during `aiayn train` save like SIGTERM (SIGPIPE changes nothing)."""

import os
import signal
import subprocess
import sys

import pytest

from aiayn.cli.main import main
from aiayn.training.checkpoint import list_checkpoints

ARGS = ["dataset=copy", "dataset_train=40", "dataset_valid=4", "dataset_test=4", "dataset_max_len=4", "vocab_size=20",
        "max_tokens=100", "threads=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
        "model.n_encoder_layers=1", "model.n_decoder_layers=1", "warmup=10", "show_examples=0"]
# `aiayn train` that runs HOOK after every optimizer step (the step number is `self.step`)
HOOKED = """
import os, signal, sys
from aiayn.training.loop import Trainer

def after_step(self):
    {hook}

Trainer.after_step = after_step
from aiayn.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def aiayn(*args, stdout, preexec_fn=None, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "aiayn", *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          preexec_fn=preexec_fn, cwd=cwd, timeout=300)
    return proc.returncode, proc.stderr.strip()


def test_a_reader_that_went_away_ends_the_command_quietly():
    read, write = os.pipe()
    os.close(read)  # `aiayn params | head -0`: nobody reads
    try:
        code, err = aiayn("params", "--preset", "base", stdout=write)
    finally:
        os.close(write)
    assert (code, err) == (0, "")


def test_a_full_disk_behind_stdout_is_one_line_naming_stdout():
    with open("/dev/full", "w") as full:
        code, err = aiayn("params", "--preset", "base", stdout=full)
    assert code == 4
    assert err == "aiayn params: error: stdout: No space left on device; free some disk space and run it again"


def test_a_closed_stdout_is_one_line_not_lost_output():
    code, err = aiayn("params", "--preset", "base", stdout=None, preexec_fn=lambda: os.close(1))
    assert code == 4
    assert err == ("aiayn params: error: stdout: the output is closed; redirect it to a file (> FILE) or give the "
                   "command's output option")


def test_an_output_option_naming_a_device_is_refused(tmp_path, capsys):
    assert main(["embed", "--model", "nowhere", "the cat", "-o", "/dev/full"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "/dev/full is a character device, not a regular file" in err


def test_training_outlives_its_reader_and_saves_the_model(tmp_path):
    read, write = os.pipe()
    os.close(read)
    try:
        code, err = aiayn("train", *ARGS, "max_steps=3", "--run", str(tmp_path / "run"), "--no-progress",
                          stdout=write)
    finally:
        os.close(write)
    assert code == 0, err
    assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["SIGHUP", "SIGQUIT"])
def test_a_hang_up_or_quit_during_training_saves_like_sigterm(tmp_path, name):
    hook = f"if self.step == 3: os.kill(os.getpid(), signal.{name})"
    default = getattr(signal, name)  # not ignored at start, as a terminal delivers it (`nohup` ignores SIGHUP)
    proc = subprocess.run([sys.executable, "-c", HOOKED.format(hook=hook), "train", *ARGS, "max_steps=50",
                           "--run", str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: signal.signal(default, signal.SIG_DFL))
    assert proc.returncode == 130, proc.stderr
    assert f"{name}: finishing this step, saving a checkpoint" in proc.stdout + proc.stderr
    assert list_checkpoints(tmp_path / "run" / "checkpoints")[-1].name == "step-00000003"


def test_sigpipe_during_training_changes_nothing(tmp_path):
    hook = "if self.step == 2: os.kill(os.getpid(), signal.SIGPIPE)"
    proc = subprocess.run([sys.executable, "-c", HOOKED.format(hook=hook), "train", *ARGS, "max_steps=4",
                           "--run", str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "trained 4 steps" in proc.stdout
