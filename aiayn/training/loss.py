"""Label-smoothed cross-entropy (section 5.4) and the token counts that go with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, *, smoothing: float) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """Summed label-smoothed cross-entropy and summed plain NLL over non-ignored positions.

    The smoothed target puts 1 - eps on the true class and eps spread evenly over all classes
    (as `torch.nn.functional.cross_entropy(label_smoothing=eps)`).

    Args:
        logits: (..., C) scores.
        labels: (...) class ids; -100 marks ignored positions.
        smoothing: epsilon_ls.

    Returns:
        (smoothed loss sum, NLL sum), both scalars in float32.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()  # (N, C)
    flat_labels = labels.reshape(-1)  # (N,)
    keep = flat_labels != IGNORE
    flat_logits, flat_labels = flat_logits[keep], flat_labels[keep]
    log_probs = F.log_softmax(flat_logits, dim=-1)  # (N, C)
    nll = -log_probs.gather(1, flat_labels[:, None])[:, 0]  # (N,)
    if smoothing > 0:
        uniform = -log_probs.mean(dim=-1)  # (N,)
        loss = (1.0 - smoothing) * nll + smoothing * uniform
    else:
        loss = nll
    return loss.sum(), nll.sum()


def correct_count(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(correct argmax predictions, counted positions) over non-ignored labels."""
    keep = labels != IGNORE
    predictions = logits.argmax(dim=-1)
    return int(((predictions == labels) & keep).sum()), int(keep.sum())
