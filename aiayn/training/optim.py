"""The optimizer of the paper's recipe: Adam with beta1 0.9, beta2 0.98, epsilon 1e-9 (section 5.3)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def make_adam(params: Iterable[torch.nn.Parameter], *, betas: tuple[float, float] = (0.9, 0.98),
              eps: float = 1e-9, weight_decay: float = 0.0, lr: float = 0.0) -> torch.optim.Adam:
    """Adam with PyTorch's fused kernel where this build has one, on CPU and CUDA (the same update, one kernel).

    The fused CPU kernel writes the parameters without bumping their version counters, which
    `aiayn.backends.weights_version` reads to tell when a prepared inference copy (the Embedder's)
    is stale; a post-step hook bumps them.
    """
    params = list(params)
    try:
        optimizer = torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)

    def mark_updated(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                torch.autograd.graph.increment_version(p)

    optimizer.register_step_post_hook(mark_updated)
    return optimizer
