"""Signals and a second process, with real processes: SIGTERM saves like Ctrl-C, a Ctrl-C while the CLI
starts is one line, a signal ignored at start (`nohup`) stays ignored, and a second `aiayn train` on a run in use
stops at once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiayn.cli.main import main
from aiayn.rundir import RunLock
from aiayn.training.checkpoint import list_checkpoints

ARGS = ["dataset=copy", "dataset_train=40", "dataset_valid=4", "dataset_test=4", "dataset_max_len=4", "vocab_size=20",
        "max_tokens=100", "threads=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
        "model.n_encoder_layers=1", "model.n_decoder_layers=1", "warmup=10", "show_examples=0", "max_steps=50"]
ROOT = Path(__file__).resolve().parents[2]

# `aiayn train` that runs HOOK after every optimizer step (the step number is `self.step`).
HOOKED = """
import os, pathlib, signal, sys, time
from aiayn.training.loop import Trainer

def after_step(self):
    {hook}

Trainer.after_step = after_step
from aiayn.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
SIGTERM_AT_3 = "if self.step == 3: os.kill(os.getpid(), signal.SIGTERM)"
WAIT_AFTER_1 = ("if self.step == 1:\n        pathlib.Path(os.environ['READY']).touch()\n"
                "        while not pathlib.Path(os.environ['GO']).exists(): time.sleep(0.05)")


def _hooked(hook, args, env=None, **kwargs):
    return subprocess.Popen([sys.executable, "-c", HOOKED.format(hook=hook), "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, **kwargs)


def test_sigterm_saves_a_checkpoint_and_exits_like_ctrl_c(tmp_path):
    proc = _hooked(SIGTERM_AT_3, [*ARGS, "--run", str(tmp_path / "run"), "--no-progress"])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "SIGTERM: finishing this step, saving a checkpoint" in out + err
    assert f"interrupted at step 3; resume with: aiayn train --run {tmp_path / 'run'} --resume" in out
    assert list_checkpoints(tmp_path / "run" / "checkpoints")[-1].name == "step-00000003"
    RunLock(tmp_path / "run").acquire().release()  # the lock went with the process


EARLY = """
import importlib.abc, os, signal, sys
class Interrupt(importlib.abc.MetaPathFinder):  # the signal comes as the CLI's modules begin to load
    def find_spec(self, name, path, target=None):
        if name == "{module}":
            os.kill(os.getpid(), signal.SIG{name})
sys.meta_path.insert(0, Interrupt())
from aiayn.cli.entry import main
sys.exit(main())
"""


@pytest.mark.parametrize(("name", "module", "line"), [("INT", "aiayn.cli.main", "aiayn: interrupted"),
                                                    ("TERM", "aiayn.cli.main", "aiayn: interrupted"),
                                                    ("INT", "tqdm", "aiayn params: interrupted")])
def test_a_signal_while_the_clis_modules_load_is_one_line(tmp_path, name, module, line):
    """From the entry point's first line (`aiayn.cli.entry`), before the CLI's own handler is in place (while its
    modules load, and between that and the handler: tqdm is imported there): no KeyboardInterrupt traceback, no
    signal lost, one line, exit 130; and Python's own handlers are back for the interpreter's exit."""
    code = EARLY.replace("{name}", name).replace("{module}", module).replace(
        "sys.exit(main())", "code = main()\nassert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
                            "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, "params", "--preset", "tiny"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (130, line, "")

def test_ctrl_c_while_the_cli_starts_is_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "aiayn", "params", "--preset", "tiny"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    time.sleep(0.4)  # importing torch and the commands takes longer than this
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip() in ("aiayn: interrupted", "aiayn params: interrupted")
    assert out == ""


def test_a_second_train_on_a_run_in_use_stops_at_once(tmp_path, capsys):
    run, ready, go = tmp_path / "run", tmp_path / "ready", tmp_path / "go"
    proc = _hooked(WAIT_AFTER_1, [*ARGS, "max_steps=2", "--run", str(run), "--no-progress"],
                   env={"READY": str(ready), "GO": str(go)})
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        metrics = (run / "metrics.jsonl").read_bytes()
        started = time.monotonic()
        assert main(["train", "--run", str(run), "--resume", "--no-progress"]) == 5
        assert main(["train", *ARGS, "--run", str(run), "--no-progress"]) == 5
        assert time.monotonic() - started < 30
        err = capsys.readouterr().err.splitlines()
        assert err == [f"aiayn train: error: {run} is in use: process {proc.pid} is training in it; wait for it "
                       "to finish or choose another --run directory"] * 2
        assert (run / "metrics.jsonl").read_bytes() == metrics  # no rows from the second process
    finally:
        go.touch()
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "trained 2 steps" in out


# A command that signals itself with what its parent ignored, then finishes.
SIGNALS_ITSELF = """
import os, signal, sys
import aiayn.cli.core

def params(args):
    os.kill(os.getpid(), signal.SIGHUP)
    os.kill(os.getpid(), signal.SIGINT)
    print("kept going")
    return 0

aiayn.cli.core.cmd_params = params
from aiayn.cli.main import main
sys.exit(main(["params"]))
"""


def _ignore_hangup_and_interrupt() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup` does
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell does for a background job


def test_signals_ignored_at_start_stay_ignored(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SIGNALS_ITSELF], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, preexec_fn=_ignore_hangup_and_interrupt)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out == "kept going\n" and err == ""


def test_the_cli_installs_no_handler_over_an_ignored_signal_and_puts_its_own_back(monkeypatch):
    seen = {}

    def params(args):
        seen.update({sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGTERM)})
        return 0

    monkeypatch.setattr("aiayn.cli.core.cmd_params", params)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        terminate = signal.getsignal(signal.SIGTERM)
        assert main(["params"]) == 0
        assert seen[signal.SIGHUP] is signal.SIG_IGN  # left as the parent set it
        assert seen[signal.SIGTERM] not in (signal.SIG_IGN, terminate)  # the CLI's own: ends the command, code 130
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == terminate
    finally:
        signal.signal(signal.SIGHUP, before)


def test_training_installs_no_handler_over_an_ignored_signal(tmp_path):
    """`nohup aiayn train ... &`: the SIGHUP nohup ignores stays ignored while the steps run, so the run outlives the
    logout; SIGTERM still finishes the step and saves."""
    from types import SimpleNamespace

    from aiayn.training.signals import interrupts_caught

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        terminate = signal.getsignal(signal.SIGTERM)
        with interrupts_caught(SimpleNamespace(interrupt_requested=False, looping=True, report=print)):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, terminate)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == terminate
    finally:
        signal.signal(signal.SIGHUP, before)
