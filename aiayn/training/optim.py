"""The optimizer of the paper's recipe: Adam with beta1 0.9, beta2 0.98, epsilon 1e-9 (section 5.3)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def make_adam(params: Iterable[torch.nn.Parameter], *, betas: tuple[float, float] = (0.9, 0.98),
              eps: float = 1e-9, weight_decay: float = 0.0, lr: float = 0.0) -> torch.optim.Adam:
    """Adam with the multi-tensor (`foreach`) implementation.

    Not `fused=True`: PyTorch's fused CPU kernel updates parameters without bumping their version
    counters, and `MultiHeadAttention` keys its cached stacked Q/K/V weights on those counters,
    so evaluation between steps would see stale weights.
    """
    return torch.optim.Adam(list(params), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)
