"""Label-smoothed cross-entropy (section 5.4) and the token counts that go with it."""

from __future__ import annotations

import torch

IGNORE = -100


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-row (1 - eps) * NLL + eps * uniform cross-entropy, with a one-pass backward.

    The forward keeps p = softmax(x) (one fused kernel) for the backward, where the gradient of the
    smoothed loss is p - (1 - eps) onehot(y) - eps / C: one pass over p, with no exponential to take
    again and no one-hot matrix. The loss needs log p only at the label and on average, both from the
    row's log-sum-exp: log p[y] = x[y] - lse, mean(log p) = mean(x) - lse, with lse = x[m] - log p[m]
    at the row's most likely class m, whose probability (at least 1 / C) has a finite log.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
        probs = torch.softmax(logits, dim=-1)  # (N, C)
        lse = logits.amax(dim=-1) - probs.amax(dim=-1).log()  # (N,): log sum_c exp(x_c), at the most likely class
        nll = lse - logits.gather(1, labels[:, None])[:, 0]  # (N,): -log p[y]
        loss = (1.0 - smoothing) * nll + smoothing * (lse - logits.mean(dim=-1)) if smoothing > 0 else nll.clone()
        ctx.save_for_backward(probs, labels)
        ctx.smoothing = smoothing
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_nll: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        probs, labels = ctx.saved_tensors
        eps = ctx.smoothing
        scale = grad_loss[:, None]  # (N, 1)
        grad = torch.addcmul(scale * (-eps / probs.shape[-1]), probs, scale)  # (p - eps / C) * scale: (N, C)
        return grad.scatter_add_(1, labels[:, None], scale * -(1.0 - eps)), None, None


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
