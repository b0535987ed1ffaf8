"""Token embeddings and positional encodings (section 3.4 and 3.5 of the paper)."""

from __future__ import annotations

import math

import torch
from torch import nn


class TokenEmbedding(nn.Module):
    """A learned table of `vocab_size` vectors of width `d_model`, optionally × sqrt(d_model).

    Section 3.4: "In the embedding layers, we multiply those weights by sqrt(d_model)."
    """

    def __init__(self, vocab_size: int, d_model: int, *, scale: bool = True, pad_id: int | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.scale = math.sqrt(d_model) if scale else 1.0
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        self.pad_id = pad_id
        nn.init.normal_(self.weight, mean=0.0, std=d_model**-0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, L) int ids -> (B, L, d_model). Raises ValueError on ids outside the vocabulary.

        No id is read back to the host on the way (this runs at every decoding step): the lookup
        itself rejects an id outside the table on CPU, and only then are the ids read to name it; on
        other devices the range is asserted on the device, asynchronously.
        """
        check_ids(ids, self.vocab_size, read_values=False)
        if ids.device.type != "cpu":
            torch._assert_async(((ids >= 0) & (ids < self.vocab_size)).all())
        try:
            out = nn.functional.embedding(ids, self.weight)  # (B, L, d_model)
        except IndexError:
            check_ids(ids, self.vocab_size)  # names the id
            raise
        return out * self.scale if self.scale != 1.0 else out


def check_ids(ids: torch.Tensor, vocab_size: int, name: str = "token id", *, read_values: bool = True) -> None:
    """Reject non-integer ids, wrong rank, and (`read_values`) ids outside [0, vocab_size)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        dtype = getattr(ids, "dtype", type(ids).__name__)
        raise ValueError(f"{name}s must be an int64 or int32 tensor, got {dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name}s must have shape (batch, length), got {tuple(ids.shape)}")
    if read_values and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0:
            raise ValueError(f"{name} {low} is negative")
        if high >= vocab_size:
            raise ValueError(f"{name} {high} is outside the vocabulary (size {vocab_size})")


TABLE_BLOCK_VALUES = 1 << 18  # values of a sinusoidal table computed at once (their float64 work: ~10 MB)


def sinusoidal_table(length: int, d_model: int, *, layout: str = "interleaved",
                     offset: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...) for pos in [offset, offset+length).

    `layout="split"` puts all sines in the first half and all cosines in the second, as
    tensor2tensor, Marian and fairseq store it.

    Returns:
        (length, d_model) table.
    """
    inv_freq = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model)
    )  # (d_model/2,)
    table = torch.empty(length, d_model, dtype=dtype)
    if table.is_meta:  # sizes only (`parameter_table`): there are no values to compute
        return table
    # Row blocks: the float64 angles, sines and cosines of a block are alive at once, not those of the whole
    # table (6x its size, for max_len=20,000,000); every row is computed as it would be in one go.
    step = max(1, TABLE_BLOCK_VALUES // max(d_model, 1))
    for start in range(0, length, step):
        end = min(start + step, length)
        position = torch.arange(offset + start, offset + end, dtype=torch.float64)[:, None]  # (l, 1)
        angles = position * inv_freq  # (l, d_model/2)
        if layout == "split":
            table[start:end] = torch.cat([angles.sin(), angles.cos()], dim=-1)  # (l, d_model)
        else:
            table[start:end] = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # sin/cos interleaved
    return table


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoidal positions (section 3.5), added to the embeddings; any length works."""

    def __init__(self, d_model: int, *, max_len: int = 1024, layout: str = "interleaved"):
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        self.layout = layout
        self.register_buffer("table", sinusoidal_table(max_len, d_model, layout=layout), persistent=False)

    def forward(self, length: int, *, offset: int = 0) -> torch.Tensor:
        """Positions [offset, offset + length) as a (length, d_model) table."""
        if offset + length <= self.table.shape[0]:
            return self.table[offset : offset + length]
        return sinusoidal_table(length, self.d_model, layout=self.layout, offset=offset).to(
            device=self.table.device, dtype=self.table.dtype
        )


class LearnedPositionalEmbedding(nn.Module):
    """A learned vector per position up to `max_len` (as in BERT); longer inputs are an error."""

    def __init__(self, d_model: int, *, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, length: int, *, offset: int = 0) -> torch.Tensor:
        """Positions [offset, offset + length) as a (length, d_model) table."""
        if offset + length > self.max_len:
            raise ValueError(
                f"sequence of {offset + length} tokens is longer than the {self.max_len} "
                "positions this model learned; truncate the input"
            )
        return self.weight[offset : offset + length]
