"""The project speaks of itself, not of how it was built: no sessions, stops, rounds or issue numbers.

A reader of the README, a guide, a docstring or a test meets what aiayn does and why; "this session" or
"issue 16" means nothing to them. Findings keep their date and machine instead (docs/notes.md).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLACES = ("README.md", "docs", "aiayn", "tests", "benchmarks", "pyproject.toml", "Makefile")
SUFFIXES = {".md", ".py", ".toml", ".txt", ".html", ".js", ".cfg", ""}
PROCESS_WORDS = re.compile(
    r"this session|(a|the next|next|same|earlier|later|previous) session|\bstop [0-9]+|"
    r"(this|last|earlier|next|previous|later) rounds?|the rounds? (before|after)|rounds before this|"
    r"\bround [0-9]+|\bissue #?[0-9]+|\bissues? [0-9]+|the lead's",
    re.IGNORECASE)


def files() -> list[Path]:
    """The project's own text files: docs, code, tests, benchmarks and their records, packaging."""
    found = []
    for place in PLACES:
        path = ROOT / place
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES | {".json"}
                      and "__pycache__" not in p.parts]
    return [p for p in found if p != Path(__file__).resolve()]


def test_no_words_of_how_the_project_was_built():
    hits = []
    for path in files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if PROCESS_WORDS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "process words (say what is measured, with its date and machine):\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_is_for():
    for text in ("as this session showed", "same machine, a session later", "(stop 29)", "in this round",
                 "an earlier round", "Issue 16's figures", "round 2", "the lead's runs"):
        assert PROCESS_WORDS.search(text), text
    for text in ("onnxruntime.InferenceSession", "a round trip", "round robin", "round(x, 2)", "stop at eos"):
        assert not PROCESS_WORDS.search(text), text
