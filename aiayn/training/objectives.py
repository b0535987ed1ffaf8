"""What each objective feeds the model and how its loss is counted.

`make_batch` collates a list of example indices of a split; `forward` returns logits and the
labels they are scored against (-100 = ignored).
"""

from __future__ import annotations

import torch
from torch import nn

from aiayn.data.collate import (
    collate_masked_lm,
    collate_seq2seq,
    collate_sequence_classification,
    collate_token_classification,
)
from aiayn.data.prepare import EncodedSplit, PreparedData


def batch_seed(seed: int, epoch: int, batch_index: int, *, stream: int = 0) -> int:
    """The seed of one batch's randomness, fixed by (seed, epoch, batch): the same in a resumed run and in
    whichever process trains the batch. `stream` keeps masking (0) and dropout (1) draws apart."""
    return seed * 1_000_003 + epoch * 100_003 + batch_index + (stream << 48)


def masking_generator(seed: int, epoch: int, batch_index: int) -> torch.Generator:
    """A generator for masked-LM corruption fixed by (seed, epoch, batch): resumed runs mask the same way."""
    return torch.Generator().manual_seed(batch_seed(seed, epoch, batch_index))


def make_batch(data: PreparedData, split: EncodedSplit, indices: list[int], *, mlm_probability: float = 0.15,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Collate the examples `indices` of `split` for the data's objective."""
    items = [split.items[i] for i in indices]
    tok = data.source_tokenizer
    if data.objective == "seq2seq":
        tgt = data.target_tokenizer
        return collate_seq2seq(items, pad_id=tok.pad_id, bos_id=tgt.bos_id, eos_id=tgt.eos_id)
    if data.objective == "sequence_classification":
        return collate_sequence_classification(items, pad_id=tok.pad_id)
    if data.objective == "token_classification":
        return collate_token_classification(items, pad_id=tok.pad_id)
    specials = [i for i in (tok.bos_id, tok.eos_id, tok.unk_id) if i is not None]
    return collate_masked_lm(items, pad_id=tok.pad_id, mask_id=tok.mask_id, vocab_size=tok.vocab_size,
                             special_ids=specials, probability=mlm_probability,
                             generator=generator if generator is not None else torch.Generator().manual_seed(0))


def forward(model: nn.Module, batch: dict[str, torch.Tensor], objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, labels) of one batch; seq2seq uses teacher forcing on the shifted target.

    Seq2seq and masked-LM project to the vocabulary only the positions the loss counts
    (N = real target tokens or masked tokens), returning logits (N, V) and labels (N,): the
    vocabulary projection is the largest matrix, and padding or unmasked positions would waste it.
    """
    labels = batch["labels"]
    if objective == "seq2seq":
        src_mask = model.source_mask(batch["src"])
        memory = model.encode(batch["src"], src_mask)  # (B, S, d_model)
        hidden = model.decode(batch["tgt_in"], memory, memory_mask=src_mask)  # (B, T, d_model)
        keep = labels != -100
        return model.head(hidden[keep]), labels[keep]  # (N, V), (N,)
    if objective == "masked_lm":
        hidden = model.encode(batch["ids"])  # (B, L, d_model)
        keep = labels != -100
        return model.head(hidden[keep]), labels[keep]  # (N, V), (N,)
    return model(batch["ids"]), labels


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's tensors on `device` (collation builds them on the CPU)."""
    return {name: t.to(device, non_blocking=True) for name, t in batch.items()}


def batch_tokens(batch: dict[str, torch.Tensor], pad_id: int) -> int:
    """Real (non-pad) input tokens in a batch, for tokens/s."""
    if "src" in batch:
        return int((batch["src"] != pad_id).sum() + (batch["labels"] != -100).sum())
    return int((batch["ids"] != pad_id).sum())


def loss_units(batch: dict[str, torch.Tensor]) -> int:
    """Positions the loss counts in a batch (target tokens, masked tokens, or sequences)."""
    return int((batch["labels"] != -100).sum())
