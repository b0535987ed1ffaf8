"""The Python examples of the README and docs/core.md run as written (each file's blocks in order, one scope)."""

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_python_blocks(name: str) -> dict:
    text = (ROOT / name).read_text(encoding="utf-8")
    scope: dict = {}
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        exec(compile(block, name, "exec"), scope)
    return scope


def test_the_readme_example_runs():
    scope = run_python_blocks("README.md")
    assert scope["logits"].shape == (1, 3, scope["model"].config.vocab_size)
    assert scope["memory"].shape == (1, 4, scope["model"].config.d_model) and len(scope["out"].tokens) == 1


def test_the_core_guide_examples_run(capsys):
    scope = run_python_blocks("docs/core.md")
    assert scope["logits"].shape == (1, 3, 1000)  # the NumPy reference's logits
    assert scope["backend"].describe() in capsys.readouterr().out
    assert scope["plain"].encoder.layers[0].self_attn.q_proj.weight is scope["model"].encoder.layers[
        0].self_attn.q_proj.weight
    assert isinstance(scope["out"].tokens[0], list)
    src, tgt = scope["src"], scope["tgt"]
    with torch.no_grad():
        torch.testing.assert_close(scope["runner"](src, tgt), scope["model"](src, tgt), atol=1e-5, rtol=0)
