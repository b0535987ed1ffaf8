"""Encoder forward throughput: aiayn vs `torch.nn.TransformerEncoder`'s fast path, and the matmul peak.

Run: `aiayn bench encoder` or `python -m benchmarks.encoder [--batch 16 --length 128 ...]`.

In one run it measures, on the same machine and threads:
- aiayn's encoder stack of the chosen preset (base: 6 layers, d_model 512, h 8, d_ff 2048), fp32, eval,
  under `torch.inference_mode()`, on a (batch, length, d_model) input without padding;
- `torch.nn.TransformerEncoder` with the same sizes and the same weights (`enable_nested_tensor=True`,
  which takes PyTorch's fused "fast path" in eval/inference mode);
- the machine's fp32 matmul peak (an n x n x n matmul, 2 n^3 FLOP);
and prints tokens/s, the ratio aiayn / torch, and aiayn's model FLOP/s as a fraction of the peak.
The contenders alternate within each repeat (so a noisy neighbour hits both alike); figures are medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from aiayn.config import preset
from aiayn.nn.model import build_encoder


def encoder_flops(batch: int, length: int, d_model: int, d_ff: int, n_layers: int) -> float:
    """Multiply-adds x 2 of one encoder forward: projections, attention scores and mixing, FFN."""
    projections = 4 * d_model * d_model  # W_Q, W_K, W_V, W_O per token
    feed_forward = 2 * d_model * d_ff  # W1, W2 per token
    attention = 2 * length * d_model  # Q K^T and weights x V per token, all heads
    return 2.0 * batch * length * n_layers * (projections + feed_forward + attention)


def copy_to_torch_layer(ours: nn.Module, theirs: nn.TransformerEncoderLayer) -> None:
    """Copy one aiayn EncoderLayer's weights into a `torch.nn.TransformerEncoderLayer`."""
    attn = ours.self_attn
    with torch.no_grad():
        theirs.self_attn.in_proj_weight.copy_(
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        theirs.self_attn.in_proj_bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        theirs.self_attn.out_proj.weight.copy_(attn.out_proj.weight)
        theirs.self_attn.out_proj.bias.copy_(attn.out_proj.bias)
        theirs.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
        theirs.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
        theirs.norm1.load_state_dict(ours.attn_sublayer.norm.state_dict())
        theirs.norm2.load_state_dict(ours.ffn_sublayer.norm.state_dict())


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


def matmul_peak(n: int, device: torch.device, repeats: int, warmup: int, iters: int) -> float:
    """Median fp32 GFLOP/s of an n x n by n x n matmul."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    fn = lambda: torch.matmul(a, b, out=out)
    for _ in range(warmup):
        fn()
    times = [_time(fn, device, iters) for _ in range(repeats)]
    return 2.0 * n**3 / statistics.median(times) / 1e9


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
    p.add_argument("--device", default="cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures; returns 0."""
    args = build_parser().parse_args(argv)
    for name in ("batch", "length", "repeats", "iters", "matmul_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = preset(args.preset).replace(dropout=0.0)
    torch.manual_seed(0)

    ours = build_encoder(cfg).to(device).eval()
    layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, cfg.d_ff, dropout=0.0, activation=cfg.activation,
                                       layer_norm_eps=cfg.layer_norm_eps, batch_first=True,
                                       norm_first=cfg.norm_first)
    theirs = nn.TransformerEncoder(layer, cfg.n_encoder_layers, enable_nested_tensor=True).to(device).eval()
    for mine, other in zip(ours.layers, theirs.layers):
        copy_to_torch_layer(mine, other)
    x = torch.randn(args.batch, args.length, cfg.d_model, device=device)

    contenders = {
        "aiayn Encoder": lambda: ours(x),
        "torch TransformerEncoder (fast path)": lambda: theirs(x),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.inference_mode():
        if not cfg.norm_first:  # torch's pre-LN stack has no final norm unless given one
            diff = (ours(x) - theirs(x)).abs().max().item()
        else:
            diff = float("nan")
        for fn in contenders.values():
            for _ in range(args.warmup):
                fn()
        order = list(contenders)
        for r in range(args.repeats):
            for name in order[r % 2:] + order[: r % 2]:  # alternate who goes first
                times[name].append(_time(contenders[name], device, args.iters))
        peak = matmul_peak(args.matmul_size, device, args.repeats, args.warmup, max(args.iters, 3))

    tokens = args.batch * args.length
    flops = encoder_flops(args.batch, args.length, cfg.d_model, cfg.d_ff, cfg.n_encoder_layers)
    print(f"encoder forward, preset {args.preset} (d_model={cfg.d_model} h={cfg.n_heads} d_ff={cfg.d_ff} "
          f"N={cfg.n_encoder_layers}), batch {args.batch} x length {args.length}, fp32, eval, inference_mode, "
          f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"model FLOP per forward: {flops / 1e9:.2f} GFLOP; max |aiayn - torch| = {diff:.2e}")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in medians.items():
        print(f"  {name:<38} {t * 1e3:9.1f} ms  {tokens / t:12,.0f} tokens/s  {flops / t / 1e9:8.1f} GFLOP/s")
    print(f"  {'fp32 matmul ' + str(args.matmul_size) + '^3 peak':<38} {'':>12}  {'':>19}  {peak:8.1f} GFLOP/s")
    ours_t, theirs_t = medians["aiayn Encoder"], medians["torch TransformerEncoder (fast path)"]
    print(f"aiayn / torch fast path throughput: {theirs_t / ours_t:.3f}x (target >= 1.0x)")
    print(f"aiayn model FLOP/s / matmul peak:   {flops / ours_t / 1e9 / peak:.1%} (target >= 90%)")
    print(f"torch model FLOP/s / matmul peak:   {flops / theirs_t / 1e9 / peak:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
