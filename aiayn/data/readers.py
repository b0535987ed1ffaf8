"""Read training data from files: parallel text, classification rows, CoNLL tags and plain text.

Every reader returns the examples it kept and a `ReadStats` counting what it skipped (empty lines,
rows over the length limit), so nothing is silently lost. A malformed row raises `DataError`
naming `file:line` and what was wrong.

Text is UTF-8; a byte-order mark at the start is dropped. Lines end only at `\n` or `\r\n`: other
characters Python counts as line breaks (form feed, U+2028, ...) stay inside a line. A CSV field in
quotes may hold a newline. A path that names an existing file is that file, commas and all. A pipe
(`train=<(zcat big.tsv.gz)`, a FIFO) is read like a file; a device or a link loop is refused by name.
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from aiayn.paths import check_input_file
from aiayn.rundir import load_json

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
    suffix = Path(path if Path(path).exists() else path.split(",")[0]).suffix.lower()
    return {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".conll": "conll",
            ".bio": "conll", ".txt": "text"}.get(suffix, "text")


def read_text_file(path: str | Path, what: str = "data file") -> str:
    """The UTF-8 text of a file or a pipe (`<(cmd)`, a FIFO) without a leading byte-order mark; one clear error
    for a missing file, a directory, a device or a link loop (`aiayn.paths.check_input_file`)."""
    path = check_input_file(path, what, stream=True)
    with open(path, "rb") as handle:  # read once: a pipe gives its bytes only once
        return decode_text(handle.read(), str(path))


def read_stdin() -> str:
    """The UTF-8 text of standard input, checked as a file's is (a closed stdin, bytes that are not UTF-8)."""
    stream = sys.stdin
    if stream is None or stream.closed:
        raise ValueError("stdin is closed: give the texts as arguments or with --input FILE")
    buffer = getattr(stream, "buffer", None)
    data = buffer.read() if buffer is not None else stream.read()
    return decode_text(data, "stdin") if isinstance(data, bytes) else data.removeprefix("\ufeff")


def decode_text(data: bytes, name: str) -> str:
    """`data` as UTF-8 text without a leading byte-order mark; DataError naming `name` and the first bad byte."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        raise DataError(f"{name}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def split_lines(text: str) -> list[str]:
    """Lines of `text`, split only at `\n` and `\r\n` (not at the other breaks `str.splitlines` knows); a text with `\r`
    and no `\n` at all has the classic Mac OS line ends, and is split at `\r` (it read as one line)."""
    if "\r" in text and "\n" not in text:
        text = text.replace("\r", "\n")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_lines(path: str | Path, what: str = "input file") -> list[str]:
    """The lines of a UTF-8 text file, or of stdin for "-" (BOM dropped, split only at line ends)."""
    if str(path) == "-":
        return split_lines(read_stdin())
    return split_lines(read_text_file(path, what))


def _lines(path: str | Path) -> list[str]:
    return read_lines(path, "data file")


def _aligned_pair(path: str) -> tuple[str, str] | None:
    """`SRC,TGT` for two aligned files, unless `path` itself is a file (a comma inside a file name)."""
    if "," not in path or Path(path).exists():
        return None
    source, target = path.split(",", 1)
    return source, target


def _json_row(path: str | Path, number: int, line: str) -> dict:
    try:
        row = load_json(line)
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
    pair = _aligned_pair(path)
    if pair is not None and detect_format(path, fmt) == "text":
        src_path, tgt_path = pair
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
        for number, cells in _csv_rows(path, lines, "," if kind == "csv" else "\t"):
            if not any(cell.strip() for cell in cells):
                stats.empty += 1
                continue
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


def _csv_rows(path: str, lines: list[str], delimiter: str) -> list[tuple[int, list[str]]]:
    """(first line number, cells) of each CSV/TSV row; a quoted field may span lines."""
    reader = csv.reader((line + "\n" for line in lines), delimiter=delimiter, strict=True)
    rows, end = [], 0
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return rows
        except csv.Error as err:
            reason = ("a carriage return (\\r) inside an unquoted field: quote the field"
                      if "new-line" in str(err) else str(err))
            raise DataError(f"{path}:{reader.line_num}: {reason}") from None
        rows.append((end + 1, cells))
        end = reader.line_num


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


def read_documents(path: str) -> tuple[list[str], ReadStats]:
    """Plain text as documents: each stretch of lines between blank lines (a paragraph, a section), its line breaks
    kept; a file without a blank line is a document each line (one string a line: messages, sentences)."""
    stats = ReadStats(path=path)
    lines = _lines(path)
    documents: list[str] = []
    if any(not line.strip() for line in lines):
        block: list[str] = []
        for line in [*lines, ""]:
            if line.strip():
                block.append(line)
            elif block:
                documents.append("\n".join(block))
                block = []
    else:
        documents = [line for line in lines]
    stats.kept = len(documents)
    return documents, stats


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
