"""`aiayn predict`: labels (classification runs) or tags per word (tagging runs) for new text."""

from __future__ import annotations

import argparse
import json
import re
import sys

from aiayn.cli.options import add_device_argument, input_lines, integer


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn predict`."""
    p = subparsers.add_parser(
        "predict", help="classify texts or tag their words with a trained classification or tagging run",
        description="Predict for TEXT arguments, the lines of --input FILE, or stdin; one output line per input "
                    "line: 'LABEL<TAB>PROBABILITY' for a classifier, 'word/TAG ...' for a tagger (--json: JSON lines).",
    )
    p.add_argument("text", nargs="*", help="texts (default: read --input or stdin)")
    p.add_argument("--run", required=True, help="a classification or tagging run (or model directory)")
    p.add_argument("--input", "-i", help="a file with one text per line ('-' for stdin)")
    p.add_argument("--json", action="store_true", help="one JSON object per line, with every probability")
    p.add_argument("--batch-size", type=integer(1), default=32, help="texts per forward pass (default 32)")
    p.add_argument("--truncate", action="store_true",
                   help="cut texts longer than the model's max_len instead of stopping with an error")
    add_device_argument(p)
    p.set_defaults(func=cmd_predict)


def _classified(text: str, prediction, as_json: bool) -> str:
    if as_json:
        if prediction is None:
            return json.dumps({"text": text, "label": None, "score": None, "scores": {}}, ensure_ascii=False)
        return json.dumps({"text": text, "label": prediction.label, "score": round(prediction.score, 6),
                           "scores": {k: round(v, 6) for k, v in prediction.scores.items()}}, ensure_ascii=False)
    return "" if prediction is None else f"{prediction.label}\t{prediction.score:.4f}"


def _tagged(text: str, tags, as_json: bool) -> str:
    if as_json:
        return json.dumps({"text": text, "tags": [{"word": t.word, "tag": t.tag, "score": round(t.score, 6)}
                                                  for t in tags]}, ensure_ascii=False)
    return " ".join(f"{t.word}/{t.tag if t.tag is not None else '?'}" for t in tags)


def _line_numbers(message: str, filled: list[int]) -> str:
    """A message about "text N" of the non-empty lines given, told about its line number instead."""
    match = re.match(r"text (\d+) ", message)
    if match is None or not 1 <= int(match.group(1)) <= len(filled):
        return message
    return f"line {filled[int(match.group(1)) - 1] + 1} " + message[match.end():]


def cmd_predict(args: argparse.Namespace) -> int:
    """Print one prediction line per input line (an empty line gives an empty prediction)."""
    from aiayn.inference.classifiers import Classifier, Tagger
    from aiayn.inference.loading import loaded_class

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    cls = loaded_class(args.run)
    if cls not in (Classifier, Tagger):
        hint = {"Translator": "aiayn translate --run", "Generator": "aiayn generate --run"}.get(
            cls.__name__, "aiayn embed --model")
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise ValueError(f"{args.run} holds a model for {article} {cls.__name__}, not a classification or tagging run; "
                         f"use {hint} {args.run}")
    model = cls.from_pretrained(args.run, device=args.device)
    lines = input_lines(args)
    filled = [i for i, line in enumerate(lines) if line.strip()]
    try:
        predictions = model.predict([lines[i] for i in filled], batch_size=args.batch_size, truncate=args.truncate)
    except ValueError as err:  # "text N ..." counts the texts given; the user counts lines
        raise ValueError(_line_numbers(str(err), filled)) from None
    found = dict(zip(filled, predictions))
    for i, line in enumerate(lines):
        if cls is Classifier:
            print(_classified(line, found.get(i), args.json), flush=True)
        else:
            print(_tagged(line, found.get(i, []), args.json), flush=True)
    print(f"{len(lines)} lines, labels: {', '.join(model.labels)}", file=sys.stderr)
    return 0
