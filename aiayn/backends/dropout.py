"""Training dropout on CPU with its mask drawn as random integers, where that was measured faster than PyTorch's.

`F.dropout` on CPU draws its mask with `bernoulli_`, one draw of PyTorch's Mersenne Twister an element, then
multiplies. On CPUs where PyTorch does not hand `bernoulli_` to MKL (it does on Intel's only), that loop takes
6-9 ns an element on one core whatever the thread count: about 7 ms forward and backward over a 4,096-token batch
of a 256-wide model, 17 times a step in the small preset. Here one 64-bit draw (`random_` on int64, the same
generator) gives four elements 16 random bits each, and an element is kept where its bits are at least p 2^16:
kept with probability 1 - p to within 2^-17 (FlashAttention's dropout, which PyTorch runs for attention on GPUs,
rounds p to 8 bits). The arithmetic after is `F.dropout`'s own: the mask in the input's type divided by 1 - p,
then one product. Runs stay seeded by `torch.manual_seed`; the masks are other draws than `F.dropout`'s.
Measured: docs/notes.md, "Training".

`calibrate.bits_dropout_faster` times both once per machine; `Backend.prepare` swaps a training copy's
`nn.Dropout` modules for `BitsDropout` where it chose so, and has its attention draw the dropout on its weights
(`attention_dropout`) the same way: on a CPU, `scaled_dot_product_attention` with dropout writes the equation out
itself and draws with `bernoulli_` (its flash kernel takes no dropout), so the layer writes it out instead.
"""

from __future__ import annotations

import torch
from torch import nn

from aiayn.nn.attention import MultiHeadAttention

BITS = 16  # random bits an element: a 64-bit draw viewed as four 16-bit integers


def bits_dropout(x: torch.Tensor, p: float, *, inplace: bool = False) -> torch.Tensor:
    """`F.dropout(x, p, training=True)` (0 < p < 1) with the mask from 16 random bits an element."""
    draws = torch.empty((x.numel() + 3) // 4, dtype=torch.int64, device=x.device)
    bits = draws.random_(-(2**63), 2**63 - 1).view(torch.int16)[: x.numel()]  # each uniform over -2^15 .. 2^15 - 1
    kept = (bits >= round(p * 2**BITS) - 2 ** (BITS - 1)).view(x.shape)
    noise = kept.to(x.dtype).div_(1 - p)  # as F.dropout: 1 / (1 - p) where kept, in the input's type
    return x.mul_(noise) if inplace else x * noise


class BitsDropout(nn.Dropout):
    """`nn.Dropout` whose training mask is drawn by `bits_dropout` on CPU; `nn.Dropout`'s own elsewhere (evaluation,
    p of 0 or 1, other devices)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not 0.0 < self.p < 1.0 or x.device.type != "cpu":
            return super().forward(x)
        return bits_dropout(x, self.p, inplace=self.inplace)


def use_bits_dropout(model: nn.Module) -> nn.Module:
    """Every `nn.Dropout` of `model` (a training copy `Backend.prepare` made) replaced by a `BitsDropout` of the same
    p, and every attention's dropout on its weights drawn by `bits_dropout`, in place; returns `model`."""
    for module in list(model.modules()):
        if isinstance(module, MultiHeadAttention):
            module.weights_dropout = bits_dropout
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, BitsDropout(child.p, inplace=child.inplace))
    return model


def draws_bits(model: nn.Module) -> bool:
    """Whether some dropout of `model` (p above 0) draws its masks by `bits_dropout`."""
    return any((isinstance(m, BitsDropout) and m.p > 0)
               or (isinstance(m, MultiHeadAttention) and m.weights_dropout is bits_dropout and m.dropout > 0)
               for m in model.modules())
