"""The memory bound of a decoding step: how fast this machine streams weights, and how many bytes a step reads.

At batch 1 a decoding step reads every weight of the decoder and of the output layer once (the memory's
keys and values are computed once per sentence, not per step), and does two flops per weight read: it is
bound by memory bandwidth, not by arithmetic. So tokens/s cannot exceed B / bytes-per-step, B the
bandwidth one product gets when it streams its weight.

B is measured, not assumed (these VMs report a large shared L3 whose share is unknown): over a buffer of
the step's own size, the faster of two reads, each the best of a few repeats:
- a one-row product over the buffer laid out (in, out) contiguous, as MKL's matrix-vector product streams
  it (the fastest one-row product measured on the CPU kinds this project runs on);
- `sum()` over the buffer, a plain sequential read.
Both run at the current torch thread count; `measure` reports each. On a GPU the same two reads run on the
device, timed between synchronisations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


@dataclass(frozen=True)
class Bandwidth:
    """Bytes per second this machine streams from memory, by how it was read."""

    product: float  # one-row product over the weight laid out (in, out)
    read: float  # sum() over the buffer
    threads: int  # 0: a GPU's memory

    @property
    def best(self) -> float:
        return max(self.product, self.read)

    def describe(self) -> str:
        where = "on the GPU" if self.threads == 0 else f"at {self.threads} thread{'s' if self.threads > 1 else ''}"
        return (f"{self.best / 1e9:.1f} GB/s {where} "
                f"(one-row product {self.product / 1e9:.1f}, sum {self.read / 1e9:.1f})")


def step_parameters(cfg) -> int:
    """Weights a decoding step reads once per step: every decoder layer's self-attention (Q, K, V, O),
    cross-attention's W_Q and W_O (its K and V read the memory once per sentence), the feed-forward network,
    and the output layer (biases and norms are a rounding error and left out)."""
    d, d_ff = cfg.d_model, cfg.d_ff
    per_layer = 4 * d * d + 2 * d * d + 2 * d * d_ff
    return cfg.n_decoder_layers * per_layer + cfg.target_vocab_size * d


def measure(nbytes: int, repeats: int = 5, device: torch.device | str = "cpu") -> Bandwidth:
    """Bandwidth over a float32 buffer of `nbytes` (at least 64 MiB, beyond a CPU's last-level cache) on `device`."""
    nbytes = max(nbytes, 64 << 20)
    width = 512
    columns = torch.randn(width, nbytes // (4 * width), device=device)  # (in, out): one row streams all of it
    row = torch.randn(1, width, device=device)
    times = {"product": [], "read": []}
    sync = (lambda: torch.cuda.synchronize(columns.device)) if columns.is_cuda else (lambda: None)
    torch.mm(row, columns), columns.sum()  # first-call costs
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        torch.mm(row, columns)
        sync()
        times["product"].append(time.perf_counter() - start)
        start = time.perf_counter()
        columns.sum()
        sync()
        times["read"].append(time.perf_counter() - start)
    size = columns.numel() * 4
    return Bandwidth(product=size / min(times["product"]), read=size / min(times["read"]),
                     threads=0 if columns.is_cuda else torch.get_num_threads())


def bound_tokens_per_second(bandwidth: Bandwidth, cfg, precision: str) -> float:
    """The most decoding steps per second at batch 1 that `bandwidth` allows for `precision`'s weights."""
    return bandwidth.best / (step_parameters(cfg) * BYTES[precision])
