"""Benchmark records: what a run printed, as figures, with the date, machine and versions it ran on.

A benchmark script calls `figure(name, value, unit)` where it prints a figure; `aiayn bench NAME --record
[DIR]` runs the script inside `recording(...)`, which keeps the printed text verbatim and writes one JSON
file per run to DIR (default `benchmarks/results/`). `benchmarks/report.py` renders the records as the
markdown tables the README and docs show. A figure without its machine is not worth keeping: a speed
ratio on an AVX2-only CPU says little about one with AMX (docs/core.md, "Every CPU: fast paths chosen by
measurement").
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import io
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The ISA flags that decide which kernels are fast (docs/core.md): oneDNN's fp32 and int8 paths need
# AVX-512 (+VNNI), bf16 is native only with AVX512-BF16 or AMX.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
# What the machine ran under: the ISA limits that emulate an older CPU, and OpenMP's wait policy, which the CLI sets to
# passive and which decides how fast more than one thread runs small operations, peers in the same process included
# (docs/notes.md, "Decoding", two threads and passive waits).
RECORDED_ENVIRONMENT = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "OMP_WAIT_POLICY",
                        "GOMP_SPINCOUNT")
# Packages whose version changes a figure: aiayn's own stack and the peers the scripts compare against.
PACKAGES = ("aiayn", "torch", "numpy", "ctranslate2", "transformers", "sentence-transformers", "onnxruntime",
            "tokenizers", "sacrebleu")

_figures: list[dict] = []


def figure(name: str, value: float, unit: str = "", **labels: object) -> None:
    """Keep one printed figure for the run's record: `figure("aiayn Encoder", 1628, "tokens/s")`; labels: `batch=1`."""
    _figures.append({"name": name, "value": float(value), "unit": unit, **labels})


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, stream) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def cpu() -> dict:
    """CPU model, family/model numbers, the ISA flags that matter, and torch's own view of the ISA."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in info:
                info[key] = value.strip()
            if not line.strip() and info:
                break
    flags = set(info.get("flags", "").split())
    capability = None
    with contextlib.suppress(Exception):
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    return {"model": info.get("model name") or platform.processor() or platform.machine(),
            "family": info.get("cpu family"), "model_number": info.get("model"),
            "isa": {flag: flag in flags for flag in ISA_FLAGS}, "torch_capability": capability,
            "env": {k: os.environ[k] for k in RECORDED_ENVIRONMENT if k in os.environ}}


def versions() -> dict[str, str]:
    """Installed versions of the packages that can change a figure (those not installed are left out)."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def commit() -> str | None:
    """The checkout's commit, with `+dirty` when the tree has changes; None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


# Environment variables that decide what aiayn runs (`aiayn.backends.calibrate`): a record's command begins with
# those set, as a shell would run it.
CHOICE_SETTINGS = ("AIAYN_DROPOUT", "AIAYN_INT8_RANGE")


@contextlib.contextmanager
def recording(name: str, argv: list[str], directory: Path | None = None) -> Iterator[dict]:
    """Run the body as benchmark `name`, then write its record to `directory`; yields the record."""
    _figures.clear()
    settings = [f"{k}={os.environ[k]}" for k in CHOICE_SETTINGS if k in os.environ]
    record: dict = {"format": FORMAT, "bench": name, "command": " ".join([*settings, "aiayn", "bench", name, *argv]),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "commit": commit(), "cpu": cpu(),
                    "cores": {"logical": os.cpu_count(), "usable": len(os.sched_getaffinity(0))
                              if hasattr(os, "sched_getaffinity") else os.cpu_count()},
                    "load_before": [round(x, 2) for x in os.getloadavg()]}
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield record
    import torch

    record.update(threads=torch.get_num_threads(), load_after=[round(x, 2) for x in os.getloadavg()],
                  versions=versions(), figures=list(_figures), output=tee.copy.getvalue())
    if torch.cuda.is_available():
        used = torch.cuda.is_initialized()  # before the properties, which initialise CUDA
        props = torch.cuda.get_device_properties(0)
        record["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                         "memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                         "torch": torch.__version__,
                         # whether this process ran on it (a bench that starts a server runs it in another)
                         "used_here": used}
    record.setdefault("note", None)
    path = write(record, directory or RESULTS_DIR)
    print(f"record: {path}")


def write(record: dict, directory: Path) -> Path:
    """Write `record` as `<date>-<bench>.json` in `directory` (created if missing), or `<date>-<bench>-2.json` ... where
    a record of the same second is there (two runs started together): never over another record; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = re.sub(r"[^0-9T]", "", record["date"].split("+")[0])  # 20261203T191500
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False, encoding="utf-8") as out:
        out.write(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    try:
        for n in itertools.count(1):
            path = directory / f"{stamp}-{record['bench']}{'' if n == 1 else f'-{n}'}.json"
            with contextlib.suppress(FileExistsError):
                os.link(out.name, path)  # whole, and only where no file is: one step
                return path
    finally:
        os.unlink(out.name)
    raise AssertionError("unreachable")


# What a record holds that the report reads, and its type: a record without them (damaged, written by another
# version, or another program's JSON) is skipped.
# The records' layout, written in each ("format"; a record without one is of format 1): a reader skips a record of a
# later format with a line, where it would misread it. Bump when a field changes meaning or goes.
FORMAT = 1
FIELDS = {"bench": str, "command": str, "date": (str, type(None)), "cpu": dict, "cores": dict, "threads": int,
          "load_before": list, "load_after": list, "versions": dict, "figures": list}
FIGURE_FIELDS = {"name": str, "value": (int, float), "unit": str}


def unreadable(record: object) -> str | None:
    """Why `record` (a file's parsed JSON) is not a benchmark record the report can show, or None when it is one."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a record (an object)"
    written = record.get("format", 1)
    if not isinstance(written, int) or isinstance(written, bool) or written < 1:
        return f"not a benchmark record (its format is {written!r}, not a number from 1)"
    if written > FORMAT:
        return f"a record of format {written}, written by a later aiayn (this one reads up to {FORMAT}): update aiayn"
    wrong = [name for name, kind in FIELDS.items() if name not in record or not isinstance(record[name], kind)]
    if wrong:
        return f"not a benchmark record this version reads (missing or of the wrong type: {', '.join(wrong)})"
    cpu, cores = record["cpu"], record["cores"]
    checks = {"figures": all(isinstance(f, dict) and all(isinstance(f.get(k), t) for k, t in FIGURE_FIELDS.items())
                             for f in record["figures"]),
              "cpu": {"model", "family", "model_number"} <= set(cpu) and isinstance(cpu.get("isa"), dict)
                     and isinstance(cpu.get("env", {}), dict),
              "cores": {"usable", "logical"} <= set(cores),
              "load": all(load and isinstance(load[0], (int, float)) for load in (record["load_before"],
                                                                                  record["load_after"]))}
    wrong = [name for name, good in checks.items() if not good]
    if wrong:
        return f"not a benchmark record this version reads (malformed: {', '.join(wrong)})"
    return None


def load(directory: Path | None = None) -> list[dict]:
    """All records in `directory` (default `benchmarks/results/`), oldest first; a file that is not one is
    skipped with a line on stderr naming it."""
    records = []
    for path in sorted((directory or RESULTS_DIR).glob("*.json")):
        if not path.is_file():  # a folder, a pipe or a device named *.json: never read (a pipe would block)
            print(f"skipped {path}: not a regular file", file=sys.stderr)
            continue
        try:
            record = json.loads(path.read_bytes())
        except OSError as err:
            print(f"skipped {path}: {err.strerror}", file=sys.stderr)
            continue
        except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, or nested past the parser
            print(f"skipped {path}: not valid JSON ({type(err).__name__}: {err})", file=sys.stderr)
            continue
        problem = unreadable(record)
        if problem:
            print(f"skipped {path}: {problem}", file=sys.stderr)
            continue
        records.append(record)
    return sorted(records, key=lambda r: r.get("date") or "")


def new_work_dir(stem: str, root: Path = Path("runs")) -> Path:
    """`root/stem-N` for the first N not taken: where a bench that trains keeps its runs unless told (`--work`)."""
    n = 1
    while (root / f"{stem}-{n}").exists():
        n += 1
    return root / f"{stem}-{n}"

