"""One prepared call for a GPU machine: the CUDA tests, `aiayn verify --device cuda`, and short training and
decoding benchmarks on CUDA against Hugging Face (decoding in CUDA graphs and launched step by step, fp32 and
bf16), then a table of what passed and the figures.

    make gpu-check                       # with the venv's python
    make gpu-check GPU_PYTHON=python3    # a machine whose own python has a CUDA build of torch
    python3 benchmarks/gpu_check.py --record DIR   # also keep the benchmarks' records in DIR

Runs from the repository root without installing anything (the package is imported from the tree).
Exit code 0 only when every step passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

STEPS = (  # the quickest and the newest first: a run cut short still says the most
    ("CUDA tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
                    "tests/inference/test_host_reads.py", "tests/inference/test_steps.py"]),
    ("bench generate (cuda, base, graphs and eager)",
     ["-m", "aiayn", "bench", "generate", "--device", "cuda", "--repeats", "3", "--peers", "hf",
      "--precisions", "fp32,bf16"]),
    ("verify --device cuda", ["-m", "aiayn", "verify", "--device", "cuda"]),
    ("bench train (cuda, small: fp32 by default)", ["-m", "aiayn", "bench", "train", "--device", "cuda",
                                                    "--steps", "12"]),
    ("bench train (cuda, base: bf16 by default)", ["-m", "aiayn", "bench", "train", "--device", "cuda", "--preset",
                                                   "base", "--steps", "12"]),
)


def main() -> int:
    """Run every step, print its output as it comes, then the summary table."""
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-check: error: no CUDA GPU here (torch {torch.__version__}); run it on a GPU machine",
              file=sys.stderr)
        return 2
    print(f"gpu-check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    record = ["--record", *sys.argv[sys.argv.index("--record") + 1 :][:1]] if "--record" in sys.argv else []
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    rows = []
    for name, args in STEPS:
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        if record and args[2] == "bench":
            args = [*args, *record]
        lines = []
        with subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as step:
            for line in step.stdout:  # as it comes: a run cut short still shows what it got to
                print(line, end="", flush=True)
                lines.append(line)
        figures = [line.strip() for line in lines if "tokens/s" in line or "passed" in line]
        rows.append((name, step.returncode, time.perf_counter() - start, figures[-3:]))
    print("\n| step | result | seconds | last figures |\n| --- | --- | --- | --- |")
    for name, code, seconds, figures in rows:
        print(f"| {name} | {'ok' if code == 0 else f'FAILED ({code})'} | {seconds:.0f} | {'; '.join(figures)} |")
    return 0 if all(code == 0 for _, code, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
