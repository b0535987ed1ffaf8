"""Turn encoded examples into padded tensors for each training objective.

Labels use -100 for positions the loss ignores (padding, special tokens, unmasked tokens).
Sequence-to-sequence uses teacher forcing: the decoder reads the target shifted right behind
`<s>` and predicts the target followed by `</s>` (section 3.1, "output embeddings are offset
by one position").
"""

from __future__ import annotations

import torch

IGNORE = -100


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    """Right-pad lists of ids to one (B, L_max) int64 tensor."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def collate_seq2seq(pairs: list[tuple[list[int], list[int]]], *, pad_id: int, bos_id: int,
                    eos_id: int) -> dict[str, torch.Tensor]:
    """(source ids, target ids) pairs -> src (B, S), tgt_in (B, T) = `<s>` + target, labels (B, T) = target + `</s>`.

    Source ids are used as given (the task encoders end them with `</s>`).
    """
    src = pad([s for s, _ in pairs], pad_id)
    tgt_in = pad([[bos_id, *t] for _, t in pairs], pad_id)
    labels = pad([[*t, eos_id] for _, t in pairs], IGNORE)
    return {"src": src, "tgt_in": tgt_in, "labels": labels}


def collate_sequence_classification(items: list[tuple[list[int], int]], *, pad_id: int) -> dict[str, torch.Tensor]:
    """(ids, label) items -> ids (B, L), labels (B,)."""
    return {"ids": pad([ids for ids, _ in items], pad_id),
            "labels": torch.tensor([label for _, label in items], dtype=torch.long)}


def collate_token_classification(items: list[tuple[list[int], list[int]]], *, pad_id: int) -> dict[str, torch.Tensor]:
    """(ids, per-token labels with -100 where ignored) items -> ids (B, L), labels (B, L)."""
    return {"ids": pad([ids for ids, _ in items], pad_id), "labels": pad([labels for _, labels in items], IGNORE)}


def collate_masked_lm(items: list[list[int]], *, pad_id: int, mask_id: int, vocab_size: int,
                      special_ids: list[int], generator: torch.Generator,
                      probability: float = 0.15) -> dict[str, torch.Tensor]:
    """BERT-style masking: pick `probability` of the real tokens; of those 80% -> `<mask>`, 10% random, 10% kept.

    Returns:
        ids (B, L) with the corruption applied, labels (B, L) holding the original id at picked
        positions and -100 elsewhere.
    """
    ids = pad(items, pad_id)
    candidates = torch.ones_like(ids, dtype=torch.bool)
    for special in {pad_id, *special_ids}:
        candidates &= ids != special
    picked = (torch.rand(ids.shape, generator=generator) < probability) & candidates
    # Every sequence with a real token predicts at least one: keeps short batches from having no loss.
    for row in range(ids.shape[0]):
        if not bool(picked[row].any()) and bool(candidates[row].any()):
            choices = candidates[row].nonzero()[:, 0]
            picked[row, choices[torch.randint(len(choices), (1,), generator=generator)]] = True
    labels = torch.where(picked, ids, torch.full_like(ids, IGNORE))
    draw = torch.rand(ids.shape, generator=generator)
    corrupted = ids.clone()
    corrupted[picked & (draw < 0.8)] = mask_id
    random_ids = torch.randint(vocab_size, ids.shape, generator=generator)
    swap = picked & (draw >= 0.8) & (draw < 0.9)
    corrupted[swap] = random_ids[swap]
    return {"ids": corrupted, "labels": labels}
