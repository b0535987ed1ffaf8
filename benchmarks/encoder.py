"""Encoder forward throughput: aiayn vs `torch.nn.TransformerEncoder`'s fast path, and the matmul peak.

Run: `aiayn bench encoder` or `python benchmarks/encoder.py [--batch 16 --length 128 ...]`.

In one run it measures, on the same machine and threads:
- aiayn's encoder stack of the chosen preset (base: 6 layers, d_model 512, h 8, d_ff 2048), fp32, eval,
  under `torch.inference_mode()`, on a (batch, length, d_model) input without padding;
- `torch.nn.TransformerEncoder` with the same sizes and the same weights (`enable_nested_tensor=True`,
  which takes PyTorch's fused "fast path" in eval/inference mode);
- the same aiayn encoder as the plain modules of `aiayn.nn` (no backend: three Q/K/V products, `F.linear`,
  which is MKL on CPU, torch's default library);
- the machine's fp32 matmul peak (an n x n x n matmul, 2 n^3 FLOP) through MKL and through oneDNN;
and prints tokens/s, the ratio aiayn / torch, and aiayn's model FLOP/s as a fraction of the higher peak.
All are timed in every repeat, in a rotating order (so a noisy neighbour hits each alike);
times are medians, ratios are medians of the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from record import figure  # benchmarks/record.py

from aiayn.backends import resolve_device, select
from aiayn.backends.cpu import onednn_product
from aiayn.config import preset
from aiayn.interop.torch_nn import to_torch_encoder
from aiayn.nn.model import build_encoder

OURS = "aiayn Encoder"
OURS_PLAIN = "aiayn Encoder, plain modules"
THEIRS = "torch TransformerEncoder (fast path)"
PEAK = "fp32 matmul peak"
PEAK_DNN = "fp32 matmul peak, oneDNN"


def encoder_flops(batch: int, length: int, d_model: int, d_ff: int, n_layers: int) -> float:
    """Multiply-adds x 2 of one encoder forward: projections, attention scores and mixing, FFN."""
    projections = 4 * d_model * d_model  # W_Q, W_K, W_V, W_O per token
    feed_forward = 2 * d_model * d_ff  # W1, W2 per token
    attention = 2 * length * d_model  # Q K^T and weights x V per token, all heads
    return 2.0 * batch * length * n_layers * (projections + feed_forward + attention)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, iters: int) -> float:
    """Seconds per call of `fn`, averaged over `iters` back-to-back calls."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def matmul(n: int, device: torch.device):
    """A function computing one fp32 n x n by n x n matmul (2 n^3 FLOP) into a preallocated output."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    return lambda: torch.matmul(a, b, out=out)


def matmul_onednn(n: int, device: torch.device):
    """The same n x n x n product through oneDNN (`torch.ops.mkldnn`), PyTorch's other CPU matmul library."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    return lambda: onednn_product(a, b)


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the encoder benchmark."""
    p = argparse.ArgumentParser(prog="aiayn bench encoder", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="base", help="model sizes (default: base)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per contender (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=1, help="forward calls per timed repeat")
    p.add_argument("--matmul-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--device", help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--profile", action="store_true",
                   help="also print where aiayn's forward spends its time (PyTorch profiler, by kind of operator)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures; returns 0."""
    args = build_parser().parse_args(argv)
    for name in ("batch", "length", "repeats", "iters", "matmul_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    cfg = preset(args.preset).replace(dropout=0.0)
    torch.manual_seed(0)

    plain = build_encoder(cfg).to(device).eval()
    backend = select(device, "inference", "fp32")
    ours = backend.prepare(plain)
    theirs = to_torch_encoder(plain, cfg, enable_nested_tensor=True).to(device).eval()  # the same weights
    x = torch.randn(args.batch, args.length, cfg.d_model, device=device)

    peak_fn = matmul(args.matmul_size, device)
    contenders = {
        OURS: lambda: ours(x),
        THEIRS: lambda: theirs(x),
        PEAK: peak_fn,
        OURS_PLAIN: lambda: plain(x),
    }
    if backend.onednn:
        # The CPU backend runs aiayn's linear layers on oneDNN (aiayn.backends.cpu): MKL, torch's default
        # for fp32 F.linear on CPU, skips its AVX-512 kernels on AMD processors. Both libraries' peaks are
        # measured and shares use the higher one.
        contenders[PEAK_DNN] = matmul_onednn(args.matmul_size, device)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.inference_mode():
        diff = (ours(x) - theirs(x)).abs().max().item()
        for fn in contenders.values():
            for _ in range(args.warmup):
                fn()
        # Every repeat times all three, in a rotating order, so that a noisy neighbour hits each alike;
        # the matmul peak is measured in the same time windows as the encoders.
        order = list(contenders)
        for r in range(args.repeats):
            shift = r % len(order)
            for name in order[shift:] + order[:shift]:
                iters = args.iters if name not in (PEAK, PEAK_DNN) else max(args.iters, 3)
                times[name].append(_time(contenders[name], device, iters))

    tokens = args.batch * args.length
    flops = encoder_flops(args.batch, args.length, cfg.d_model, cfg.d_ff, cfg.n_encoder_layers)
    peak_flops = 2.0 * args.matmul_size**3
    print(f"backend: {backend.describe()}")
    print(f"encoder forward, preset {args.preset} (d_model={cfg.d_model} h={cfg.n_heads} d_ff={cfg.d_ff} "
          f"N={cfg.n_encoder_layers}), batch {args.batch} x length {args.length}, fp32, eval, inference_mode, "
          f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"model FLOP per forward: {flops / 1e9:.2f} GFLOP; max |aiayn - torch| = {diff:.2e}; "
          f"{args.repeats} repeats, medians")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name in (OURS, OURS_PLAIN, THEIRS):
        if name in medians:
            t = medians[name]
            print(f"  {name:<38} {t * 1e3:9.1f} ms  {tokens / t:12,.0f} tokens/s  {flops / t / 1e9:8.1f} GFLOP/s")
            figure(name, tokens / t, "tokens/s")
    for name in (PEAK, PEAK_DNN):
        if name in medians:
            peak = peak_flops / medians[name] / 1e9
            print(f"  {name:<38} {medians[name] * 1e3:9.1f} ms  {'':>19}  {peak:8.1f} GFLOP/s")
            figure(name, peak, "GFLOP/s")
    # Paired ratios (same repeat, so the same background load) are steadier than ratios of medians;
    # the peak of each repeat is the faster of the two libraries' products.
    peaks = [min(t) for t in zip(*(times[name] for name in (PEAK, PEAK_DNN) if name in times))]
    for name in (OURS, OURS_PLAIN):
        if name not in times:
            continue
        speedup = statistics.median(b / a for a, b in zip(times[name], times[THEIRS]))
        share = statistics.median((flops / a) / (peak_flops / p) for a, p in zip(times[name], peaks))
        print(f"{name}: {speedup:.3f}x the torch fast path (target >= 1.0x), "
              f"{share:.1%} of the matmul peak (target >= 95%)")
        figure(f"{name} / fast path", speedup, "x")
        figure(f"{name}, share of peak", 100 * share, "%")
    torch_share = statistics.median((flops / b) / (peak_flops / p) for b, p in zip(times[THEIRS], peaks))
    print(f"torch fast path: {torch_share:.1%} of the matmul peak")
    figure(f"{THEIRS}, share of peak", 100 * torch_share, "%")
    if args.profile:
        print_profile(lambda: ours(x), flops, 2.0 * args.batch * args.length * cfg.n_encoder_layers
                      * 2 * args.length * cfg.d_model)
    return 0


KINDS = (("matrix products (linear layers)", ("linear", "addmm", "mm", "matmul", "bmm")),
         ("attention (scaled_dot_product_attention)", ("attention",)),
         ("LayerNorm", ("layer_norm",)),
         ("elementwise (residual add, activation)", ("add", "relu", "gelu", "mul", "copy_", "clamp")))


def print_profile(forward, flops: float, attention: float) -> None:
    """Share of self time per kind of operator over two forwards, beside the products' and attention's
    shares of the model's FLOPs (`attention`: those of Q K^T and the weights times V)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        forward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            forward()
            forward()
    spent: dict[str, float] = {}
    for event in prof.key_averages():
        kind = next((k for k, words in KINDS if any(w in event.key for w in words)), "other")
        spent[kind] = spent.get(kind, 0.0) + event.self_cpu_time_total
    total = sum(spent.values())
    shares = {KINDS[0][0]: 1 - attention / flops, KINDS[1][0]: attention / flops}
    print("where aiayn's forward spends its time (self CPU time, profiler), and each kind's share of the FLOPs:")
    for kind in [k for k, _ in KINDS] + ["other"]:
        if kind in spent:
            share = f"{shares[kind]:.1%}" if kind in shares else "-"
            print(f"  {kind:<44} {spent[kind] / total:6.1%} of the time   {share:>6} of the FLOPs")


if __name__ == "__main__":
    raise SystemExit(main())
