"""The one mask convention of aiayn, and the helpers that build masks.

Convention: a mask is a boolean tensor in which **True means "may attend"**. It broadcasts to the
attention scores of shape (B, h, L_q, L_k): a padding mask is (B, 1, 1, L_k), the look-ahead
(causal) mask is (1, 1, L_q, L_k). This is also the convention of
`torch.nn.functional.scaled_dot_product_attention` for boolean masks, and the opposite of
`torch.nn.MultiheadAttention`'s `key_padding_mask` (where True means "ignore").
Masks that come from outside go through `check_mask`, which rejects a wrong dtype or shape.
"""

from __future__ import annotations

import torch


def padding_mask(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Keys that are real tokens.

    Args:
        ids: token ids (B, L).
        pad_id: the padding id.

    Returns:
        Bool mask (B, 1, 1, L), True where `ids != pad_id`.
    """
    if ids.dim() != 2:
        raise ValueError(f"token ids must have shape (batch, length), got {tuple(ids.shape)}")
    return (ids != pad_id)[:, None, None, :]


def causal_mask(length: int, device: torch.device | None = None, *, offset: int = 0) -> torch.Tensor:
    """The decoder's look-ahead mask (section 3.2.3): position i may attend to positions <= i.

    Args:
        length: number of query positions L_q.
        device: where to build it.
        offset: positions already in a key/value cache; keys are `offset + length` long.

    Returns:
        Bool mask (1, 1, L_q, offset + L_q).
    """
    query_pos = torch.arange(offset, offset + length, device=device)[:, None]
    key_pos = torch.arange(offset + length, device=device)[None, :]
    return (key_pos <= query_pos)[None, None]


def check_mask(mask: torch.Tensor, batch: int, q_len: int, k_len: int) -> torch.Tensor:
    """Validate an attention mask from outside and return it as (B or 1, 1 or h, L_q or 1, L_k).

    Accepts (B, L_k) key-padding masks, (L_q, L_k), (B, L_q, L_k) and 4-D masks. A 2-D mask that
    could be either of the first two (B == L_q, both above 1) is refused rather than guessed.

    Raises:
        ValueError: the dtype is not bool, the shape does not broadcast to (B, h, L_q, L_k), or it is ambiguous.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        dtype = getattr(mask, "dtype", type(mask).__name__)
        raise ValueError(f"attention mask must be a bool tensor (True = may attend), got {dtype}")
    if mask.dim() == 2 and mask.shape == (batch, k_len) and batch == q_len and batch > 1:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} is ambiguous: batch and query length are both {batch}; "
            f"pass a key-padding mask as (B, 1, 1, L_k) or a query-key mask as (1, 1, L_q, L_k)"
        )
    if mask.dim() == 2 and mask.shape == (batch, k_len) and (batch != q_len or batch == 1):
        mask = mask[:, None, None, :]  # (B, 1, 1, L_k)
    elif mask.dim() == 2:
        mask = mask[None, None]  # (1, 1, L_q, L_k)
    elif mask.dim() == 3:
        mask = mask[:, None]  # (B, 1, L_q, L_k)
    elif mask.dim() != 4:
        raise ValueError(f"attention mask must have 2 to 4 dimensions, got shape {tuple(mask.shape)}")
    b, _, q, k = mask.shape
    if b not in (1, batch) or q not in (1, q_len) or k != k_len:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} does not fit "
            f"(batch {batch}, queries {q_len}, keys {k_len})"
        )
    return mask


def key_padding_from_attention_mask(mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Turn a Hugging Face style (B, L) 0/1 or bool `attention_mask` into (B, 1, 1, L) bool."""
    if mask.shape != ids.shape:
        raise ValueError(
            f"attention_mask of shape {tuple(mask.shape)} must match the ids' shape {tuple(ids.shape)}"
        )
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or not torch.all((mask == 0) | (mask == 1)):
            raise ValueError("attention_mask must hold only 0/1 integers or bools (1 = real token)")
        mask = mask.bool()
    return mask[:, None, None, :]
