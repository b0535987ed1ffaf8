"""Behaviours of the CLI that succeed where they once went wrong: resuming past a damaged checkpoint, writing beside
foreign files, pipes read as files, a disk that fills mid-run (the scene: tests/hardening/conftest.py)."""

import errno
import json
import os
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from aiayn.cli.main import main
from tests.hardening.conftest import TINY_RUN, truncate


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
    assert json.loads((scene / "train_config.json").read_text())["dataset"] == "copy"


def test_export_may_replace_its_own_earlier_export(scene, capsys):
    assert main(["export", "--model", "enc", "--out", "export"]) == 0
    assert json.loads((scene / "export" / "aiayn_export.json").read_text()) == {"format": "hf"}
    (scene / "mine").mkdir()
    (scene / "mine" / "keep.txt").write_text("the user's\n")
    assert main(["export", "--model", "enc", "--out", "mine", "--force"]) == 0  # forced: beside the user's files
    assert (scene / "mine" / "keep.txt").read_text() == "the user's\n"


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
