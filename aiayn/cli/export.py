"""`aiayn export`: a trained translator or an encoder written for other tools, then checked against aiayn.

Translators go to Hugging Face (Marian when post-LN, Pegasus when pre-LN) or CTranslate2, encoders to
sentence-transformers or ONNX (`aiayn.export`).
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `export`."""
    p = subparsers.add_parser(
        "export", help="write a trained model (or an encoder) for Hugging Face, sentence-transformers, CTranslate2 or "
                       "ONNX, checked against aiayn",
        description="A translation run becomes a Hugging Face model, Marian for post-LN layers and Pegasus for "
                    "pre-LN ones (or, with --ctranslate2, a CTranslate2 model); an encoder a sentence-transformers "
                    "model (or, with --onnx, an ONNX graph); a decoder-only language model a Hugging Face GPT-2 "
                    "model. Each comes with its tokenizer, and the export is then checked: a fixed set of texts goes "
                    "through the exported model and through aiayn, and the agreement is printed.")
    p.add_argument("--model", "--run", dest="model",
                   help="a run or model directory, BERT checkpoint or hub id (default: all-MiniLM-L6-v2)")
    p.add_argument("--out", "-o", required=True, help="output directory")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--onnx", action="store_true", help="an encoder as OUT/model.onnx (+ tokenizer)")
    kind.add_argument("--ctranslate2", action="store_true",
                      help="a translator as a CTranslate2 model (needs pip install ctranslate2)")
    p.add_argument("--quantization", help="CTranslate2 weight type: int8, int8_float32, float16, ... (default float32)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with aiayn")
    p.add_argument("--force", action="store_true",
                   help="write into a directory of files aiayn did not write (refused otherwise; a run, model or "
                        "checkpoint directory, or a folder inside one, is refused even so)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """Export, then print where and how well the export agrees with aiayn."""
    from aiayn.cli.errors import INTERNAL
    from aiayn.export import export

    fmt = "onnx" if args.onnx else "ctranslate2" if args.ctranslate2 else "hf"
    result = export(args.model, args.out, fmt=fmt, quantization=args.quantization, force=args.force,
                    check=not args.no_check)
    print(f"wrote {result.format} files to {result.path}")
    for check in result.checks:
        print(f"check: {check}")
    failed = [check for check in result.checks if check.failed]
    if failed:  # written, but it computes something else: never a success
        print(f"aiayn export: error: the export in {result.path} computes something else than aiayn on "
              f"{failed[0].total - failed[0].agreed} of {failed[0].total} check inputs ({failed[0]}); do not use it "
              "in aiayn's place", file=sys.stderr)
        return INTERNAL
    return 0
