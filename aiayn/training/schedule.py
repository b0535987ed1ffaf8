"""Learning-rate schedules: the paper's warmup then inverse square root (section 5.3)."""

from __future__ import annotations


def noam_lr(step: int, *, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) for step >= 1 (equation 3)."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def learning_rate(step: int, *, schedule: str, d_model: int, warmup: int, lr_scale: float, lr: float) -> float:
    """The rate of optimizer step `step` (1-based) under the named schedule."""
    if schedule == "noam":
        return noam_lr(step, d_model=d_model, warmup=warmup, scale=lr_scale)
    return lr
