"""`aiayn bench NAME`: side-by-side measurements against peers and the machine's limits.

Each benchmark is a module `benchmarks.<name>` with `main(argv) -> int`; run them on a quiet machine.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "encoder": "encoder forward throughput vs torch.nn.TransformerEncoder fast path and matmul peak",
    "train": "training step throughput vs a torch.nn.Transformer step",
    "generate": "greedy and beam decoding vs Hugging Face generate()",
    "embed": "sentence embedding with all-MiniLM-L6-v2 vs sentence-transformers and BertModel",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn bench`."""
    p = subparsers.add_parser("bench", help="measure speed against peers (see benchmarks/)")
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one benchmark module."""
    try:
        module = importlib.import_module(f"benchmarks.{args.name}")
    except ModuleNotFoundError as err:
        raise ValueError(f"benchmark {args.name!r} is not available ({err})") from None
    return int(module.main(args.rest) or 0)
