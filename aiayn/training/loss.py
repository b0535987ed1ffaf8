"""Label-smoothed cross-entropy (section 5.4) and the token counts that go with it."""

from __future__ import annotations

import torch

IGNORE = -100


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-row (1 - eps) * NLL + eps * uniform cross-entropy, with a one-pass backward.

    With log p = log_softmax(x) (one fused kernel): NLL = -log p[y], uniform = -mean(log p); the
    gradient of the smoothed loss is softmax(x) - (1 - eps) onehot(y) - eps / C = exp(log p) - ...,
    computed without a one-hot matrix.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
        log_probs = torch.log_softmax(logits, dim=-1)  # (N, C)
        nll = -log_probs.gather(1, labels[:, None])[:, 0]  # (N,)
        loss = (1.0 - smoothing) * nll - smoothing * log_probs.mean(dim=-1) if smoothing > 0 else nll.clone()
        ctx.save_for_backward(log_probs, labels)
        ctx.smoothing = smoothing
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_nll: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        log_probs, labels = ctx.saved_tensors
        eps = ctx.smoothing
        grad = torch.exp(log_probs)  # softmax (N, C)
        if eps > 0:
            grad.sub_(eps / log_probs.shape[-1])
        grad.scatter_add_(1, labels[:, None], torch.full_like(grad_loss[:, None], -(1.0 - eps)))
        return grad.mul_(grad_loss[:, None]), None, None


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
        (smoothed loss sum, NLL sum), scalars in float32 (float64 for float64 logits).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, C)
    if flat_logits.dtype in (torch.float16, torch.bfloat16):
        flat_logits = flat_logits.float()  # the softmax in full precision
    flat_labels = labels.reshape(-1)  # (N,)
    keep = flat_labels != IGNORE
    if not bool(keep.all()):  # callers that already dropped ignored positions skip this copy
        flat_logits, flat_labels = flat_logits[keep], flat_labels[keep]
    loss, nll = _SmoothedCrossEntropy.apply(flat_logits, flat_labels, float(smoothing))
    return loss.sum(), nll.sum()


def correct_count(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(correct argmax predictions, counted positions) over non-ignored labels."""
    keep = labels != IGNORE
    predictions = logits.argmax(dim=-1)
    return int(((predictions == labels) & keep).sum()), int(keep.sum())
