"""`aiayn bench NAME`: side-by-side measurements against peers and the machine's limits.

Each benchmark is a script in the source tree, `benchmarks/NAME.py`, with `main(argv) -> int`; it is
not part of the installed package (the library never imports it). `aiayn bench NAME ARGS` loads the
script from the checkout aiayn runs from and calls its `main`; `python benchmarks/NAME.py ARGS` does
the same. Run them on a quiet machine.

`aiayn bench NAME --record [DIR]` also writes what the run printed, as figures with the date, the machine
(CPU model, ISA flags, cores, threads, load) and the versions, to one JSON record in DIR (default
`benchmarks/results/`, see `benchmarks/record.py`); `aiayn bench report [DIR]` prints the records as
the markdown tables the README and docs show.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import aiayn

BENCHMARKS = {
    "encoder": "encoder forward throughput vs torch.nn.TransformerEncoder fast path and matmul peak",
    "train": "training step throughput on real-run shapes vs Hugging Face Marian and torch.nn.Transformer (--model "
             "decoder-only: vs Hugging Face GPT-2)",
    "translate": "English -> French from this machine's gettext catalogs: aiayn vs Marian trained alike, BLEU and time",
    "lm": "a language model on a text of yours: aiayn vs nanoGPT's model and training loop in the same time, loss per "
          "character",
    "generate": "greedy and beam decoding vs CTranslate2 and Hugging Face generate(), fp32 and int8",
    "file": "a trained run translating a test file vs its CTranslate2 export: time, BLEU and chrF",
    "embed": "sentence embedding with all-MiniLM-L6-v2 vs sentence-transformers and BertModel",
    "long": "encoder forward at lengths 1,024-16,384: time and peak memory against the L x L matrix",
    "serve": "aiayn serve under N concurrent clients vs one request at a time and the in-process object",
    "report": "print the benchmark records of DIR (default benchmarks/results/) as markdown tables",
}
BENCHMARK_DIR = Path(aiayn.__file__).resolve().parent.parent / "benchmarks"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn bench`."""
    p = subparsers.add_parser("bench", help="measure speed against peers (scripts in benchmarks/)",
                              description="Run benchmarks/NAME.py from the source tree; arguments after NAME "
                                          "go to the script (see `aiayn bench NAME --help`, e.g. --device), "
                                          "except `--record [DIR]`, which also writes the run's figures, machine "
                                          "and versions to a JSON record in DIR (default benchmarks/results/).")
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=cmd_bench)


def load_benchmark(name: str) -> ModuleType:
    """The script `benchmarks/<name>.py` of the source tree, loaded as a module (not installed, not cached)."""
    path = BENCHMARK_DIR / f"{name}.py"
    if name not in BENCHMARKS or not path.is_file():
        raise FileNotFoundError(f"benchmark script {path} not found: benchmarks are scripts in the aiayn source "
                                "tree, not installed with the package; run aiayn from a checkout (pip install -e .)")
    _scripts_importable()
    spec = importlib.util.spec_from_file_location(f"aiayn_benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import leaves it: a script's dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _scripts_importable() -> None:
    """Let the scripts import their shared helpers (benchmarks/interleave.py, record.py), as when run directly."""
    if str(BENCHMARK_DIR) not in sys.path:
        sys.path.insert(0, str(BENCHMARK_DIR))


def split_record(rest: list[str]) -> tuple[list[str], str | None]:
    """Take `--record [DIR]` out of the script's arguments: (the rest, DIR or "" for the default, or None)."""
    if "--record" not in rest:
        return rest, None
    i = rest.index("--record")
    if i + 1 < len(rest) and not rest[i + 1].startswith("-"):
        return rest[:i] + rest[i + 2:], rest[i + 1]
    return rest[:i] + rest[i + 1:], ""


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one benchmark script's `main` with the remaining arguments, recording it when asked."""
    rest, directory = split_record(args.rest)
    if args.name == "report":
        return int(load_benchmark("report").main(rest) or 0)
    module = load_benchmark(args.name)
    if directory is None:
        return int(module.main(rest) or 0)
    import record  # benchmarks/record.py, importable once a script is loaded

    with record.recording(args.name, rest, Path(directory) if directory else None):
        code = int(module.main(rest) or 0)
    return code
