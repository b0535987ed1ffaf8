"""Output heads: the vocabulary projection (Linear + softmax) and the encoder-only task heads."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.nn.feedforward import make_activation


class VocabularyHead(nn.Module):
    """The pre-softmax linear transformation (section 3.4); its weight may be the embedding's."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> logits (B, T, V)."""
        return self.proj(hidden)


def pool(hidden: torch.Tensor, mask: torch.Tensor | None, how: str) -> torch.Tensor:
    """Pool (B, L, d) states to (B, d): "first" token ([CLS]) or "mean" over real tokens.

    Args:
        hidden: (B, L, d).
        mask: (B, L) bool, True for real tokens; None means all real.
        how: "first" or "mean".
    """
    if how == "first":
        if hidden.shape[1] == 0:
            raise ValueError("cannot pool the first token of empty sequences (length 0)")
        return hidden[:, 0]
    if mask is None:
        return hidden.sum(dim=1) / max(hidden.shape[1], 1)  # an empty sequence pools to zeros
    weights = mask.to(hidden.dtype).unsqueeze(-1)  # (B, L, 1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


class SequenceClassificationHead(nn.Module):
    """Pool the sequence, then a Linear to `num_labels` logits."""

    def __init__(self, d_model: int, num_labels: int, *, pooling: str = "first", dropout: float = 0.0):
        super().__init__()
        self.pooling = pooling
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(d_model, num_labels)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, d_model) -> (B, num_labels)."""
        return self.classifier(self.dropout(pool(hidden, mask, self.pooling)))


class TokenClassificationHead(nn.Module):
    """A Linear to `num_labels` logits at every position (tagging)."""

    def __init__(self, d_model: int, num_labels: int, *, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(d_model, num_labels)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, d_model) -> (B, L, num_labels)."""
        return self.classifier(self.dropout(hidden))


class MaskedLMHead(nn.Module):
    """BERT's masked-LM head: Linear -> activation -> LayerNorm -> vocabulary Linear `proj` (+ bias; BERT's
    `decoder`, a name that here means the decoder stack)."""

    def __init__(self, d_model: int, vocab_size: int, *, activation: str = "gelu", eps: float = 1e-12):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.activation = make_activation(activation)
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.proj = nn.Linear(d_model, vocab_size)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, d_model) -> vocabulary logits (B, L, V)."""
        return self.proj(self.norm(self.activation(self.dense(hidden))))
