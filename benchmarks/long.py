"""Long sequences: encoder forward time and peak memory at lengths 1,024 to 16,384, against the L x L matrix.

A naive implementation of attention holds the scores softmax(Q K^T / sqrt(d_k)), one L x L matrix per
head and layer: h L^2 floats, 8 GiB at L = 16,384 with 8 heads. aiayn's encoder (the backend's
inference copy, batch 1, no padding) calls `scaled_dot_product_attention`, whose CPU kernel (flash
attention) computes the same in blocks and never holds the whole matrix, so memory grows with L, not L^2.

Each length runs in a fresh process, so its peak resident memory (`ru_maxrss`) belongs to that length
alone; the figure is the peak during the forward minus what the process held just before (model and
input built, one short warm-up forward). `--naive-max` also runs the written-out equation
(`need_weights=True`, asked through `attention_weights`) up to that length, to show the matrix it holds.

    aiayn bench long [--lengths 1024,2048,4096,8192,16384] [--threads N] [--naive-max 4096]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from aiayn.backends import select
from aiayn.config import preset
from aiayn.nn.attention import attention_weights
from aiayn.nn.model import build_encoder


def _resident_bytes() -> int:
    """This process's resident memory now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(length: int, preset_name: str, naive: bool) -> dict:
    """Seconds and peak bytes above the starting point of one encoder forward at `length` (this process)."""
    cfg = preset(preset_name).replace(dropout=0.0)
    torch.manual_seed(0)
    plain = build_encoder(cfg).eval()
    encoder = plain if naive else select("cpu", "inference", "fp32").prepare(plain)
    x = torch.randn(1, length, cfg.d_model)  # (B, L, d_model)

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        if not naive:
            return encoder(inputs)
        # the equation written out: each layer's weights (B, h, L, L) are materialised, then freed
        with attention_weights([layer.self_attn for layer in encoder.layers], keep=False):
            for layer in encoder.layers:
                inputs = layer(inputs)
        return inputs

    with torch.inference_mode():
        forward(torch.randn(1, 64, cfg.d_model))  # warm up: allocator and kernels
        before = _resident_bytes()
        start = time.perf_counter()
        out = forward(x)
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    assert out.shape == x.shape and bool(torch.isfinite(out).all())
    return {"length": length, "seconds": seconds, "peak_bytes": peak - before, "heads": cfg.n_heads,
            "layers": cfg.n_encoder_layers, "d_model": cfg.d_model}


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the long-sequence benchmark."""
    p = argparse.ArgumentParser(prog="aiayn bench long", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="comma-separated sequence lengths")
    p.add_argument("--preset", default="base", help="model sizes (default: base, d_model 512, 8 heads, 6 layers)")
    p.add_argument("--naive-max", type=int, default=4096,
                   help="also run the written-out attention up to this length (0: never)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one length in this process
    p.add_argument("--naive", action="store_true", help=argparse.SUPPRESS)
    return p


def _run_child(length: int, args: argparse.Namespace, naive: bool) -> dict:
    """`measure` in a fresh Python process (its own peak memory)."""
    cmd = [sys.executable, __file__, "--one", str(length), "--preset", args.preset, "--threads", str(args.threads)]
    done = subprocess.run(cmd + (["--naive"] if naive else []), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"length": length, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table; returns 0."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure(args.one, args.preset, args.naive)))
        return 0
    lengths = [int(n) for n in args.lengths.split(",")]
    cfg = preset(args.preset)
    print(f"encoder forward, preset {args.preset} (d_model {cfg.d_model}, {cfg.n_heads} heads, "
          f"{cfg.n_encoder_layers} layers), batch 1, fp32, {args.threads or torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; backend {select('cpu', 'inference', 'fp32').describe()}")
    print("peak: resident memory during the forward above what the process held before it (one process per row)")
    print(f"{'length':>7} {'path':<12} {'seconds':>8} {'tokens/s':>9} {'peak MiB':>9} {'h L^2 MiB':>10} "
          f"{'peak / hL^2':>11}")
    for length in lengths:
        for naive in (False, True):
            if naive and length > args.naive_max:
                continue
            row = _run_child(length, args, naive)
            path = "written out" if naive else "fused (SDPA)"
            matrix = cfg.n_heads * length * length * 4 / 2**20  # one layer's scores, float32
            if "error" in row:
                print(f"{length:>7} {path:<12} failed: {row['error']}")
                continue
            peak = row["peak_bytes"] / 2**20
            print(f"{length:>7} {path:<12} {row['seconds']:>8.2f} {length / row['seconds']:>9.0f} {peak:>9.0f} "
                  f"{matrix:>10.0f} {peak / matrix:>11.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
