"""`aiayn corpus`: write a real parallel corpus that this machine already has as train/valid/test TSV files."""

from __future__ import annotations

import argparse
import json
import sys

from aiayn.cli.options import integer
from aiayn.config import MAX_INT


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn corpus`."""
    c = subparsers.add_parser(
        "corpus", help="write English -> LANG pairs from the system's gettext catalogs",
        description="Read the compiled gettext catalogs (/usr/share/locale/LANG/LC_MESSAGES/*.mo), keep the "
                    "msgid -> msgstr pairs that are text (no format templates), one translation per English "
                    "source, and write a seeded train/valid/test split as TSV files.")
    c.add_argument("--lang", default="fr", help="target language of the catalogs (default: fr)")
    c.add_argument("--out", required=True, help="directory for train.tsv, valid.tsv, test.tsv and corpus.json")
    c.add_argument("--locale-dir", default="/usr/share/locale", help="where the catalogs are")
    c.add_argument("--valid", type=integer(0), default=1000, help="valid pairs (default 1000)")
    c.add_argument("--test", type=integer(0), default=2000, help="test pairs (default 2000)")
    c.add_argument("--seed", type=integer(0, MAX_INT), default=0)
    c.set_defaults(func=cmd_corpus)


def cmd_corpus(args: argparse.Namespace) -> int:
    """Write the gettext corpus."""
    from aiayn.data.gettext import read_gettext
    from aiayn.rundir import check_export_dir, claim_for_export

    # the corpus directory is marked as aiayn's (aiayn_export.json) before a file is written, so that a later
    # `aiayn corpus` may replace it and nothing else is ever replaced: a directory of the user's own is refused
    check_export_dir(args.out, option="--out", force_hint="remove them first", writer="the corpus")
    corpus = read_gettext(args.lang, locale_dir=args.locale_dir, seed=args.seed, n_valid=args.valid,
                          n_test=args.test)
    out = claim_for_export(args.out, fmt="corpus", option="--out", force_hint="remove them first",
                           writer="the corpus")
    corpus.write(out)
    info = {"lang": args.lang, "locale_dir": args.locale_dir, "seed": args.seed, "catalogs": corpus.catalogs,
            "skipped": corpus.skipped, "messages": corpus.messages, "templates_dropped": corpus.templates,
            "pairs": {name: len(getattr(corpus, name)) for name in ("train", "valid", "test")}}
    from aiayn.rundir import atomic_write_bytes

    atomic_write_bytes(out / "corpus.json", (json.dumps(info, indent=2) + "\n").encode())
    for skipped in corpus.skipped:
        print(f"skipped {skipped}", file=sys.stderr)
    print(f"{len(corpus.catalogs)} catalogs, {corpus.messages} messages, {corpus.templates} templates dropped, "
          f"{sum(info['pairs'].values())} unique English sources: {info['pairs']['train']} train, "
          f"{info['pairs']['valid']} valid, {info['pairs']['test']} test pairs in {out}")
    return 0
