"""Read training data from files: parallel text, classification rows, CoNLL tags and plain text.

Every reader returns the examples it kept and a `ReadStats` counting what it skipped (empty lines,
rows over the length limit), so nothing is silently lost. A malformed row raises `DataError`
naming `file:line` and what was wrong.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

FORMATS = ("auto", "tsv", "csv", "jsonl", "text", "conll")


class DataError(ValueError):
    """A malformed data row; the message starts with `file:line:`."""


@dataclass
class ReadStats:
    """What a reader kept and skipped."""

    path: str = ""
    kept: int = 0
    empty: int = 0
    empty_side: list[int] = field(default_factory=list)  # line numbers of pairs with one side empty
    too_long: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: `train.tsv: 980 kept, 12 empty lines skipped, 8 over the length limit dropped`."""
        parts = [f"{self.kept} kept"]
        if self.empty:
            parts.append(f"{self.empty} empty lines skipped")
        if self.empty_side:
            lines = ", ".join(map(str, self.empty_side[:3])) + (", ..." if len(self.empty_side) > 3 else "")
            parts.append(f"{len(self.empty_side)} pairs with an empty side skipped (line {lines})")
        if self.too_long:
            parts.append(f"{self.too_long} over the length limit dropped")
        return f"{self.path}: " + ", ".join(parts)


@dataclass(frozen=True)
class ParallelExample:
    """One source sentence and its translation."""

    source: str
    target: str


@dataclass(frozen=True)
class LabelledText:
    """One text and its class label."""

    text: str
    label: str


@dataclass(frozen=True)
class TaggedTokens:
    """Words of a sentence and one tag per word."""

    tokens: tuple[str, ...]
    tags: tuple[str, ...]


def detect_format(path: str, fmt: str = "auto") -> str:
    """The reader format for `path`: `fmt` unless "auto", else guessed from the extension."""
    if fmt not in FORMATS:
        raise ValueError(f"data format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    suffix = Path(path.split(",")[0]).suffix.lower()
    return {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".conll": "conll",
            ".bio": "conll", ".txt": "text"}.get(suffix, "text")


def _lines(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def _json_row(path: str | Path, number: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number}: invalid JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
    return row


def _field(path: str | Path, number: int, row: dict, name: str) -> str:
    if name not in row:
        raise DataError(f"{path}:{number}: missing field {name!r} (has {', '.join(sorted(row)) or 'none'})")
    value = row[name]
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise DataError(f"{path}:{number}: field {name!r} must be a string, got {type(value).__name__}")
    return str(value)


def read_parallel(path: str, *, fmt: str = "auto", source_field: str = "source",
                  target_field: str = "target") -> tuple[list[ParallelExample], ReadStats]:
    """Parallel text: TSV `source<TAB>target`, JSONL objects, or two aligned files given as `SRC,TGT`."""
    stats = ReadStats(path=path)
    examples: list[ParallelExample] = []
    if "," in path and detect_format(path, fmt) == "text":
        src_path, tgt_path = path.split(",", 1)
        sources, targets = _lines(src_path), _lines(tgt_path)
        if len(sources) != len(targets):
            raise DataError(f"{src_path}:{min(len(sources), len(targets)) + 1}: the aligned files have "
                            f"{len(sources)} and {len(targets)} lines ({tgt_path})")
        for number, (src, tgt) in enumerate(zip(sources, targets), start=1):
            if not src.strip() and not tgt.strip():
                stats.empty += 1
                continue
            if not src.strip() or not tgt.strip():
                stats.empty_side.append(number)  # nothing to learn from; counted and reported
                continue
            examples.append(ParallelExample(src.strip(), tgt.strip()))
        stats.kept = len(examples)
        return examples, stats
    kind = detect_format(path, fmt)
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            stats.empty += 1
            continue
        if kind == "jsonl":
            row = _json_row(path, number, line)
            src, tgt = _field(path, number, row, source_field), _field(path, number, row, target_field)
        elif kind == "tsv":
            cells = line.split("\t")
            if len(cells) != 2:
                raise DataError(f"{path}:{number}: expected 2 tab-separated columns (source, target), "
                                f"got {len(cells)}")
            src, tgt = cells
        else:
            raise ValueError(f"{path}: parallel text must be .tsv, .jsonl or two files SRC,TGT (format {kind!r})")
        if not src.strip() or not tgt.strip():
            stats.empty_side.append(number)
            continue
        examples.append(ParallelExample(src.strip(), tgt.strip()))
    stats.kept = len(examples)
    return examples, stats


def read_classification(path: str, *, fmt: str = "auto", text_field: str = "text",
                        label_field: str = "label") -> tuple[list[LabelledText], ReadStats]:
    """Classification rows: CSV/TSV `text,label` (an optional header row `text,label`) or JSONL objects."""
    stats = ReadStats(path=path)
    examples: list[LabelledText] = []
    kind = detect_format(path, fmt)
    lines = _lines(path)
    if kind in ("csv", "tsv"):
        delimiter = "," if kind == "csv" else "\t"
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                stats.empty += 1
                continue
            try:
                cells = next(csv.reader([line], delimiter=delimiter, strict=True))
            except csv.Error as err:
                raise DataError(f"{path}:{number}: {err}") from None
            if number == 1 and [c.strip().lower() for c in cells] == [text_field, label_field]:
                continue  # header row
            if len(cells) != 2:
                raise DataError(f"{path}:{number}: expected 2 columns (text, label), got {len(cells)}")
            text, label = cells[0].strip(), cells[1].strip()
            if not text or not label:
                raise DataError(f"{path}:{number}: empty {'text' if not text else 'label'}")
            examples.append(LabelledText(text, label))
    elif kind == "jsonl":
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                stats.empty += 1
                continue
            row = _json_row(path, number, line)
            text, label = _field(path, number, row, text_field).strip(), _field(path, number, row, label_field).strip()
            if not text or not label:
                raise DataError(f"{path}:{number}: empty {'text' if not text else 'label'}")
            examples.append(LabelledText(text, label))
    else:
        raise ValueError(f"{path}: classification data must be .csv, .tsv or .jsonl (format {kind!r})")
    stats.kept = len(examples)
    return examples, stats


def read_conll(path: str) -> tuple[list[TaggedTokens], ReadStats]:
    """CoNLL-style tags: one `token tag` per line (the tag is the last column), sentences split by blank lines.

    Lines starting with `-DOCSTART-` are skipped.
    """
    stats = ReadStats(path=path)
    examples: list[TaggedTokens] = []
    tokens: list[str] = []
    tags: list[str] = []
    for number, line in enumerate([*_lines(path), ""], start=1):
        if line.startswith("-DOCSTART-"):
            continue
        if not line.strip():
            if tokens:
                examples.append(TaggedTokens(tuple(tokens), tuple(tags)))
                tokens, tags = [], []
            continue
        cells = line.split()
        if len(cells) < 2:
            raise DataError(f"{path}:{number}: expected 'token tag', got {line.strip()!r}")
        tokens.append(cells[0])
        tags.append(cells[-1])
    stats.kept = len(examples)
    return examples, stats


def read_text(path: str) -> tuple[list[str], ReadStats]:
    """Plain text, one example per line (for masked-LM pretraining); empty lines are counted and skipped."""
    stats = ReadStats(path=path)
    examples: list[str] = []
    for line in _lines(path):
        if not line.strip():
            stats.empty += 1
            continue
        examples.append(line.strip())
    stats.kept = len(examples)
    return examples, stats
