"""One prepared call for a GPU machine: the CUDA tests, `aiayn verify --device cuda`, and short training and
decoding benchmarks on CUDA against Hugging Face, then a table of what passed and the figures.

    make gpu-check                       # with the venv's python
    make gpu-check GPU_PYTHON=python3    # a machine whose own python has a CUDA build of torch

Runs from the repository root without installing anything (the package is imported from the tree).
Exit code 0 only when every step passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

STEPS = (
    ("CUDA tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
                    "tests/inference/test_host_reads.py"]),
    ("verify --device cuda", ["-m", "aiayn", "verify", "--device", "cuda"]),
    ("bench train (cuda, small, bf16 default)", ["-m", "aiayn", "bench", "train", "--device", "cuda", "--steps", "20"]),
    ("bench generate (cuda, base, quick)", ["-m", "aiayn", "bench", "generate", "--device", "cuda", "--quick",
                                            "--peers", "hf", "--precisions", "fp32"]),
)


def main() -> int:
    """Run every step, print its output as it comes, then the summary table."""
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-check: error: no CUDA GPU here (torch {torch.__version__}); run it on a GPU machine",
              file=sys.stderr)
        return 2
    print(f"gpu-check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    rows = []
    for name, args in STEPS:
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        print(done.stdout, flush=True)
        figures = [line.strip() for line in done.stdout.splitlines() if "tokens/s" in line or "passed" in line]
        rows.append((name, done.returncode, time.perf_counter() - start, figures[-3:]))
    print("\n| step | result | seconds | last figures |\n| --- | --- | --- | --- |")
    for name, code, seconds, figures in rows:
        print(f"| {name} | {'ok' if code == 0 else f'FAILED ({code})'} | {seconds:.0f} | {'; '.join(figures)} |")
    return 0 if all(code == 0 for _, code, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
