"""The position-wise feed-forward network (section 3.3): FFN(x) = max(0, x W1 + b1) W2 + b2."""

from __future__ import annotations

import torch
from torch import nn

_ACTIVATIONS = {
    "relu": lambda inplace: nn.ReLU(inplace=inplace),
    "gelu": lambda inplace: nn.GELU(),
    "gelu_tanh": lambda inplace: nn.GELU(approximate="tanh"),
}


def make_activation(name: str, *, inplace: bool = False) -> nn.Module:
    """The activation module for a config name ("relu", "gelu", "gelu_tanh"); ReLU may work in place."""
    try:
        return _ACTIVATIONS[name](inplace)
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(_ACTIVATIONS)}") from None


class PositionwiseFeedForward(nn.Module):
    """Two linear maps with an activation between, applied to every position with the same weights."""

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu", dropout: float = 0.0,
                 bias: bool = True):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        # In place: the hidden layer is a fresh (B, L, d_ff) tensor, and not allocating a second one
        # saves time (ReLU's backward needs only its output, so autograd is unaffected).
        self.activation = make_activation(activation, inplace=True)
        self.dropout = nn.Dropout(dropout)  # on the hidden layer, as tensor2tensor and torch do
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d_model) -> (B, L, d_model); positions never mix."""
        hidden = self.activation(self.linear1(x))  # (B, L, d_ff)
        return self.linear2(self.dropout(hidden))
