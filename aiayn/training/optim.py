"""The optimizer of a run's recipe: Adam (the paper's, section 5.3) or AdamW (fine-tuning)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from aiayn.training.schedule import Recipe


def make_optimizer(params: Iterable[torch.nn.Parameter], recipe: Recipe) -> torch.optim.Optimizer:
    """Adam or AdamW with PyTorch's fused kernel where this build has one (the same update, one kernel per tensor).

    Each step sets its own rate (`aiayn.training.loop.get_lr`). With weight decay, biases and LayerNorm weights
    (every parameter with fewer than two dimensions) are not decayed, as in BERT's fine-tuning recipe.

    The fused CPU kernel writes the parameters without bumping their version counters, which
    `aiayn.backends.weights_version` reads to tell when a prepared inference copy (the Embedder's)
    is stale; a post-step hook bumps them.
    """
    params = [p for p in params if p.requires_grad]
    if recipe.weight_decay:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params, "weight_decay": 0.0}]
    kind = torch.optim.AdamW if recipe.optimizer == "adamw" else torch.optim.Adam
    settings = {"lr": recipe.peak_lr, "betas": recipe.betas, "eps": recipe.eps}
    try:
        optimizer = kind(groups, fused=True, **settings)
    except (RuntimeError, TypeError):
        return kind(groups, foreach=True, **settings)

    def mark_updated(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                torch.autograd.graph.increment_version(p)

    optimizer.register_step_post_hook(mark_updated)
    return optimizer


def make_adam(params: Iterable[torch.nn.Parameter], *, betas: tuple[float, float] = (0.9, 0.98),
              eps: float = 1e-9, weight_decay: float = 0.0, lr: float = 0.0) -> torch.optim.Optimizer:
    """The paper's Adam at a fixed rate (for benchmarks and tests that step by hand)."""
    recipe = Recipe(optimizer="adam", schedule="constant", peak_lr=lr, warmup=1, total_steps=1, betas=betas, eps=eps,
                    weight_decay=weight_decay)
    return make_optimizer(params, recipe)
