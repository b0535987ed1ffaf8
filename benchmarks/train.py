"""Training-step throughput: aiayn's encoder-decoder vs a step built on `torch.nn.Transformer`, and the matmul peak.

Run: `aiayn bench train` or `python benchmarks/train.py [--preset base --batch 8 --src-len 32 --tgt-len 32]`.

In one run it measures, on the same machine and threads, a full training step (forward, label-smoothed
cross-entropy 0.1, backward, Adam(0.9, 0.98, 1e-9) step, the trainer's fused Adam for both) of:
- aiayn's model of the chosen preset (base: d_model 512, 6+6 layers, h 8, d_ff 2048, 37,000 shared vocabulary,
  tied embeddings, dropout 0.1), through `aiayn.training`'s loss, prepared by the trainer's backend
  (`aiayn.backends`: oneDNN linear layers and fused Q/K/V on CPU), and once more as the plain modules of
  `aiayn.nn` (every product on PyTorch's default, MKL) for comparison;
- the same sizes built on `torch.nn.Transformer` (batch_first, post-LN, ReLU, dropout 0.1) with a shared,
  tied embedding x sqrt(d_model), sinusoidal positions, a causal mask from `generate_square_subsequent_mask`,
  and `F.cross_entropy(label_smoothing=0.1)`;
- the machine's fp32 matmul peak (an n x n x n matmul, 2 n^3 FLOP), by PyTorch's default and by oneDNN.
Batches hold random tokens, source and target lengths drawn per sentence (right-padded), identical for both.
Model FLOPs count the forward pass (projections, attention, FFN, vocabulary projection) x 3 for training.
All three are timed in every repeat, in rotating order; times are medians, and the per-batch ratios
(both steps on the same batch, back to back) show how much a noisy neighbour moved them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends import select
from aiayn.backends.cpu import onednn_product
from aiayn.config import ModelConfig, preset
from aiayn.nn.embedding import sinusoidal_table
from aiayn.nn.model import build_model
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.objectives import forward
from aiayn.training.optim import make_adam


def step_flops(cfg: ModelConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Training FLOPs of one step: 3 x the forward multiply-adds x 2."""
    d, ff = cfg.d_model, cfg.d_ff
    enc = src_len * cfg.n_encoder_layers * (4 * d * d + 2 * d * ff + 2 * src_len * d)
    dec_per_token = 4 * d * d + 2 * d * d + 2 * d * ff + 2 * tgt_len * d + 2 * src_len * d  # self, cross Q/O, FFN
    dec = tgt_len * cfg.n_decoder_layers * dec_per_token + src_len * cfg.n_decoder_layers * 2 * d * d  # cross K/V
    head = tgt_len * d * cfg.target_vocab_size
    return 3 * 2.0 * batch * (enc + dec + head)


class TorchTransformerMT(nn.Module):
    """The same model built on `torch.nn.Transformer`: shared tied embeddings, sinusoidal positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_model = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        self.register_buffer("pe", sinusoidal_table(cfg.max_len, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers,
                                          cfg.d_ff, cfg.dropout, batch_first=True)
        self.pad_id = cfg.pad_id

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embed(ids) * math.sqrt(self.d_model) + self.pe[: ids.shape[1]])

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """(B, S), (B, T) -> logits (B, T, V)."""
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        pad = src == self.pad_id
        hidden = self.transformer(self._embed(src), self._embed(tgt), tgt_mask=causal, tgt_is_causal=True,
                                  src_key_padding_mask=pad, memory_key_padding_mask=pad)
        return hidden @ self.embed.weight.T  # tied pre-softmax projection


def make_batches(cfg: ModelConfig, n: int, batch: int, src_len: int, tgt_len: int, seed: int = 0):
    """`n` batches of random ids with per-sentence lengths in [len/2, len], right-padded; labels -100 on padding."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s_lens = torch.randint(src_len // 2, src_len + 1, (batch,), generator=gen)
        t_lens = torch.randint(tgt_len // 2, tgt_len + 1, (batch,), generator=gen)
        src = torch.randint(4, cfg.vocab_size, (batch, src_len), generator=gen)
        tgt = torch.randint(4, cfg.vocab_size, (batch, tgt_len + 1), generator=gen)
        src[torch.arange(src_len)[None] >= s_lens[:, None]] = cfg.pad_id
        tgt_in, labels = tgt[:, :-1].clone(), tgt[:, 1:].clone()
        tgt_in[torch.arange(tgt_len)[None] >= t_lens[:, None]] = cfg.pad_id
        labels[torch.arange(tgt_len)[None] >= t_lens[:, None]] = -100
        out.append((src, tgt_in, labels))
    return out


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return make_adam(model.parameters(), lr=1e-4)  # the trainer's Adam (fused kernel), for both


def aiayn_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One aiayn training step, as `aiayn.training` runs it (vocabulary logits only where the loss counts).

    `model` is the trainer's prepared copy (`aiayn.backends`), or the plain model for comparison.
    """
    src, tgt_in, labels = batch
    opt.zero_grad(set_to_none=True)
    logits, kept = forward(model, {"src": src, "tgt_in": tgt_in, "labels": labels}, "seq2seq")
    loss, _ = label_smoothed_loss(logits, kept, smoothing=0.1)
    (loss / int((labels != -100).sum())).backward()
    opt.step()


def torch_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One step of the torch.nn.Transformer model."""
    src, tgt_in, labels = batch
    opt.zero_grad(set_to_none=True)
    logits = model(src, tgt_in)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           label_smoothing=0.1)
    loss.backward()
    opt.step()


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(n: int = 1024, repeats: int = 5, *, onednn: bool = False,
                device: torch.device | str = "cpu") -> float:
    """fp32 FLOP/s of an n x n x n matmul (best of `repeats`), by PyTorch's default or by oneDNN (CPU)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    product = (lambda: onednn_product(a, b)) if onednn else (lambda: a @ b)
    product()
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        product()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def main(argv: list[str] | None = None) -> int:
    """Print tokens/s for both steps, the ratio, and aiayn's FLOP/s as a fraction of the matmul peak."""
    parser = argparse.ArgumentParser(prog="aiayn bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--tgt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20, help="timed steps of each model")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each model first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the best available)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = preset(args.preset)
    backend = select(args.device, "train")
    device = backend.device
    ours, theirs = build_model(cfg).train(), TorchTransformerMT(cfg).to(device).train()
    plain = build_model(cfg).train()
    plain.load_state_dict(ours.state_dict())
    prepared = backend.prepare(ours)  # shares `ours`' parameters (moved to the device), as in the trainer
    plain.to(device)
    opt_ours, opt_theirs, opt_plain = _optimizer(ours), _optimizer(theirs), _optimizer(plain)
    batches = [tuple(t.to(device) for t in batch)
               for batch in make_batches(cfg, args.repeats + args.warmup, args.batch, args.src_len, args.tgt_len)]
    real_tokens = [int((s != cfg.pad_id).sum() + (lab != -100).sum()) for s, _, lab in batches]
    params = sum(p.numel() for p in ours.parameters())
    print(f"train step, preset {args.preset} ({params / 1e6:.1f}M parameters), batch {args.batch}, "
          f"source <= {args.src_len}, target <= {args.tgt_len} tokens, {torch.get_num_threads()} threads, "
          f"backend {backend.describe()}")
    steps = {"aiayn": (aiayn_step, prepared, opt_ours), "torch.nn.Transformer": (torch_step, theirs, opt_theirs),
             "aiayn, plain modules": (aiayn_step, plain, opt_plain)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    peaks, peaks_onednn = [], []
    for i, batch in enumerate(batches):
        order = list(steps)[i % len(steps):] + list(steps)[:i % len(steps)]  # rotate who goes first
        for name in order:
            step, model, opt = steps[name]
            _sync(device)
            start = time.perf_counter()
            with backend.autocast():  # bf16 mixed precision on a CUDA GPU that has it, for both
                step(model, opt, batch)
            _sync(device)
            if i >= args.warmup:
                seconds[name].append(time.perf_counter() - start)
                times[name].append(seconds[name][-1] / real_tokens[i])
        if i >= args.warmup:
            peaks.append(matmul_peak(device=device))
            if backend.onednn:
                peaks_onednn.append(matmul_peak(onednn=True))
    peak = max(statistics.median(peaks), statistics.median(peaks_onednn or peaks))
    flops = step_flops(cfg, args.batch, args.src_len, args.tgt_len)  # on the padded shapes, as computed
    rates = {name: 1.0 / statistics.median(t) for name, t in times.items()}
    for name, rate in rates.items():
        achieved = flops / statistics.median(seconds[name])
        print(f"  {name:22s} {rate:10.0f} tokens/s (real source + target tokens)   {achieved / 1e9:7.1f} "
              f"model GFLOP/s ({100 * achieved / peak:.0f}% of peak)")
    onednn_peak = f", {statistics.median(peaks_onednn) / 1e9:.1f} GFLOP/s (oneDNN)" if peaks_onednn else ""
    print(f"  fp32 matmul peak       {statistics.median(peaks) / 1e9:10.1f} GFLOP/s (PyTorch's default)"
          f"{onednn_peak}; peak = the higher")
    for name in ("aiayn", "aiayn, plain modules"):
        ratios = [t / o for o, t in zip(seconds[name], seconds["torch.nn.Transformer"])]
        print(f"  {name} / torch.nn.Transformer: {rates[name] / rates['torch.nn.Transformer']:.2f}x "
              f"(median of per-batch ratios {statistics.median(ratios):.2f}x, "
              f"range {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
