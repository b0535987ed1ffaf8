"""`aiayn train processes=N`: the CLI launches the run's data-parallel processes itself."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from aiayn.training import Trainer, load_run_config
from aiayn.training.checkpoint import latest_checkpoint
from tests.training.test_distributed import ARGS, _assert_weights_close, _torchrun

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _aiayn(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "aiayn", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, **kwargs)


def _ranks(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the processes `launcher` started (read from their environments)."""
    found = {}
    for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        rank = next(int(item[5:]) for item in environ if item.startswith(b"RANK="))
        found[rank] = int(child)
    return found


def _train_rows(run_dir: Path) -> int:
    try:
        return sum('"train"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def test_two_processes_train_what_torchrun_trains(tmp_path):
    """The launched processes are torchrun's: the weights of one process on the same global batch, rank 0 speaking."""
    proc = _aiayn("train", *ARGS, "processes=2", "--run", str(tmp_path / "run"), "--no-progress")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert "2 processes" in out + err and (out + err).count("trained ") == 1  # rank 0 speaks for both
    one = tmp_path / "one"
    Trainer(load_run_config(None, [*ARGS, "global_batches=2"]), one).fit()
    _assert_weights_close(load_file(tmp_path / "run" / "model.safetensors"), load_file(one / "model.safetensors"))
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["processes"] == 2  # a resume relaunches


def test_ctrl_c_saves_a_checkpoint_of_every_process_at_one_step_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    long = [a for a in ARGS if not a.startswith("epochs=")] + ["epochs=1000", "save_every=1000"]
    launcher = _aiayn("train", *long, "processes=2", "--run", str(run_dir), "--no-progress")
    deadline = time.monotonic() + 120
    while _train_rows(run_dir) < 5 and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    launcher.send_signal(signal.SIGINT)  # the terminal's Ctrl-C reaches the launcher alone (its own session)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, out[-2000:] + err[-2000:]
    saved = latest_checkpoint(run_dir / "checkpoints")
    assert (out + err).count(f"interrupted at step {int(saved.name[5:])}; resume with") == 1
    resumed = _aiayn("train", "--run", str(run_dir), "--resume", f"max_steps={int(saved.name[5:]) + 2}",
                     "--no-progress")
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, out[-2000:] + err[-2000:]
    assert "resumed from" in out + err and (run_dir / "model.safetensors").exists()


def test_a_process_that_dies_stops_the_run_with_rank_0s_one_line(tmp_path):
    run_dir = tmp_path / "run"
    long = [a for a in ARGS if not a.startswith("epochs=")] + ["epochs=1000"]
    launcher = _aiayn("train", *long, "processes=2", "--run", str(run_dir), "--no-progress")
    deadline = time.monotonic() + 120
    while _train_rows(run_dir) < 3 and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    os.kill(_ranks(launcher)[1], signal.SIGKILL)
    out, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 4, out[-2000:] + err[-2000:]  # rank 0's code: a system failure
    assert "another process of the run has stopped" in err


def test_a_warning_about_the_data_is_printed_once_not_by_every_process(tmp_path):
    data = tmp_path / "train.tsv"
    lines = ["a b c\t" + " ".join(["x"] * 400)] + [f"{n} apples\t{n} pommes" for n in range(60)]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tiny = ["max_steps=2", "vocab_size=300", "recipe=paper", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
            "model.n_encoder_layers=1", "model.n_decoder_layers=1"]
    proc = _aiayn("train", f"train={data}", *tiny, "processes=2", "--run", str(tmp_path / "run"), "--no-progress")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert err.count("over the length limits") == 1, err  # rank 0's, not rank 1's again


def test_more_processes_than_cores_is_refused_in_one_line_before_any_work(tmp_path):
    proc = _aiayn("train", *ARGS, f"processes={os.cpu_count() + 1}", "--run", str(tmp_path / "run"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert f"processes={os.cpu_count() + 1} is more than the" in err and not (tmp_path / "run").exists()


def test_a_run_directory_refused_stops_the_launch_in_one_line_and_torchrun_ranks_without_an_internal_error(tmp_path):
    """`aiayn train processes=2` looks at the directory before it starts any process: one line. Under torchrun the
    ranks start first; rank 0 refuses while the other waits for it, which says its peer stopped, not a traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")
    proc = _aiayn("train", *ARGS, "processes=2", "--run", str(run), "--no-progress")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 2 and err.splitlines() == [
        f"aiayn train: error: {run} holds files aiayn did not write (notes.txt); training would write config.json, "
        "model.safetensors and logs into it: choose a new --run directory, or pass --force to write there anyway"], err
    proc = _torchrun(tmp_path, run, ARGS)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "internal error" not in proc.stderr and "another process of the run has stopped" in proc.stderr
    assert (run / "notes.txt").read_text() == "mine\n"


def test_a_layout_chosen_for_the_run_starts_its_processes_with_it_and_one_run_keeps_one(tmp_path, monkeypatch, capsys):
    """processes=0 (the default): the CLI asks `layout.choose`; the processes it starts are told the answer (they do
    not decide again), and a run it keeps in one process saves processes=1, so a resume runs the same layout."""
    from aiayn.cli import processes as launcher
    from aiayn.cli.main import main
    from aiayn.training import layout

    started = []
    monkeypatch.setattr(launcher, "train_processes", lambda argv, n, threads: started.append((argv, n, threads)) or 0)
    monkeypatch.setattr(layout, "choose", lambda run, **kw: layout.Layout(2, "2 processes of one thread: measured"))
    args = [a for a in ARGS if a != "threads=1"]
    assert main(["train", *args, "threads=2", "--run", str(tmp_path / "two"), "--no-progress"]) == 0
    [(argv, n, threads)] = started
    assert n == 2 and threads == 0 and argv[argv.index("threads=2") + 1:][:2] == ["processes=2", "threads=0"]
    assert "training as 2 processes of one thread" in capsys.readouterr().err
    monkeypatch.setattr(layout, "choose", lambda run, **kw: layout.Layout(1, "2 threads"))
    assert main(["train", *ARGS, "max_steps=1", "--run", str(tmp_path / "one"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "one" / "train_config.json").read_text())["processes"] == 1
