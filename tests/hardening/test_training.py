"""Training settings and data that cannot do what they say are refused in one line (or, for threads, cut with a
warning), before a model is presented as trained."""

import json
import logging
import os

import pytest
import torch

from aiayn.cli.main import main
from aiayn.training.setup import usable_threads

TINY_RUN = ["dataset=copy", "dataset_train=40", "dataset_valid=4", "dataset_test=4", "dataset_max_len=4",
            "vocab_size=20", "max_tokens=100", "threads=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
            "model.n_encoder_layers=1", "model.n_decoder_layers=1", "warmup=10", "show_examples=0"]


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.err.strip()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def files(directory):
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file() and
            p.name != ".aiayn.lock"}


def test_a_budget_too_short_for_one_step_fails_and_presents_no_model(tmp_path, capsys, threads):
    run = tmp_path / "run"
    code, err = run_cli(["train", *TINY_RUN, "time_budget=1s", "--run", str(run), "--no-progress"], capsys)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("aiayn train: error: time_budget=1s is too short to train one "
                                                   "step"), err
    assert "nothing was trained or saved as a model" in err and "--resume time_budget=" in err
    assert not (run / "config.json").exists() and not (run / "model.safetensors").exists()
    assert not (run / "checkpoints").exists()


def test_a_run_ended_by_a_short_budget_resumes_with_a_longer_one(tmp_path, capsys, threads):
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "time_budget=1s", "--run", str(run), "--no-progress"]) == 2
    capsys.readouterr()
    code, err = run_cli(["train", "time_budget=15s", "max_steps=2", "--run", str(run), "--resume", "--no-progress"],
                        capsys)
    assert code == 0, err
    assert (run / "model.safetensors").is_file()


def test_more_threads_than_cores_are_cut_to_the_cores_with_a_warning(caplog):
    cores = len(os.sched_getaffinity(0))
    with caplog.at_level(logging.WARNING, logger="aiayn.training.setup"):
        assert usable_threads(1000) == cores
    assert [r.getMessage() for r in caplog.records] == [
        f"threads=1000 is more than the {cores} cores this process may use: training with {cores} threads"]
    caplog.clear()
    assert usable_threads(1) == 1 and not caplog.records


def test_train_with_a_thousand_threads_runs_on_the_cores(tmp_path, capsys, caplog, threads):
    args = [a for a in TINY_RUN if not a.startswith("threads=")]
    with caplog.at_level(logging.WARNING, logger="aiayn.training.setup"):
        code, err = run_cli(["train", *args, "threads=1000", "max_steps=1", "--run", str(tmp_path / "run"),
                             "--no-progress"], capsys)
    assert code == 0, err
    assert any("threads=1000 is more than the" in r.getMessage() for r in caplog.records)
    assert torch.get_num_threads() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("item", ["vocab_size=50", "tokenizer=char", "objective=masked_lm", "lowercase=true"])
def test_a_resume_override_that_cannot_apply_is_refused(tmp_path, capsys, threads, item):
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "max_steps=1", "--run", str(run), "--no-progress"]) == 0
    capsys.readouterr()
    before = files(run)
    code, err = run_cli(["train", item, "max_steps=2", "--run", str(run), "--resume", "--no-progress"], capsys)
    assert code == 2
    assert err == (f"aiayn train: error: --resume keeps the run's tokenizer, objective and starting encoder; drop "
                   f"{item} (or start a new --run)")
    assert files(run) == before
    # the same value the run has is no change, and a setting a resume does apply passes
    code, err = run_cli(["train", "vocab_size=20", "max_steps=2", "--run", str(run), "--resume", "--no-progress"],
                        capsys)
    assert code == 0, err


def test_a_jsonl_line_nested_too_deeply_names_its_file_and_line(tmp_path, capsys, threads):
    data = tmp_path / "pairs.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    data.write_text(json.dumps({"source": "a b", "target": "b a"}) + "\n" + deep + "\n")
    code, err = run_cli(["train", f"train={data}", "vocab_size=20", "max_steps=1", "--run", str(tmp_path / "run"),
                         "--no-progress"], capsys)
    assert code == 2
    assert err.count("\n") == 0 and "RecursionError" not in err
    assert f"{data}:2: invalid JSON (nested too deeply" in err


def test_a_second_stack_for_a_decoder_only_model_is_refused_not_dropped(tmp_path, capsys, threads):
    text = tmp_path / "text.txt"
    text.write_text("one two three\nfour five six\n" * 20, encoding="utf-8")
    code, err = run_cli(["train", "objective=causal_lm", f"train={text}", "max_steps=2", "vocab_size=40",
                         "model.d_model=16", "model.d_ff=32", "model.n_heads=2", "model.n_decoder_layers=2",
                         "--run", str(tmp_path / "run"), "--no-progress"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model.n_decoder_layers=2 names the decoder of an encoder-decoder model" in err
    assert "set model.n_layers=2 instead" in err
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_a_language_models_depth_is_n_layers_and_only_its(tmp_path, capsys, threads):
    text = tmp_path / "text.txt"
    text.write_text("one two three\nfour five six\n" * 20, encoding="utf-8")
    small = ["max_steps=1", "vocab_size=40", "model.d_model=16", "model.d_ff=32", "model.n_heads=2"]
    code, _ = run_cli(["train", "objective=causal_lm", f"train={text}", *small, "model.n_layers=3",
                       "--run", str(tmp_path / "lm"), "--no-progress"], capsys)
    assert code == 0
    saved = json.loads((tmp_path / "lm" / "config.json").read_text())
    assert (saved["n_encoder_layers"], saved["n_decoder_layers"], saved["causal"]) == (3, 0, True)
    for extra, problem in ((["objective=causal_lm", "model.n_encoder_layers=2", "model.n_layers=3"],
                            "both set the language model's depth"),
                           (["objective=causal_lm", "model.n_layers=three"], "model.n_layers expects an integer"),
                           (["model.n_layers=3"], "model.n_layers is the depth of a decoder-only language model")):
        code, err = run_cli(["train", *extra, f"train={text}", *small,
                             "--run", str(tmp_path / "refused"), "--no-progress"], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and problem in err, err
        assert not (tmp_path / "refused").exists()
