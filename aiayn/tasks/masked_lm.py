"""Masked language modelling (BERT's pre-training): predict corrupted tokens; scored on loss alone."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.data.collate import collate_masked_lm
from aiayn.data.prepare import PreparedData
from aiayn.tasks.base import Task
from aiayn.tasks.names import MASKED_LM


class MaskedLM(Task):
    """Corrupted ids in, the original ids at the picked positions out (80% `<mask>`, 10% random, 10% kept)."""

    name = MASKED_LM
    head = MASKED_LM

    def collate(self, data: PreparedData, items: list, *, mlm_probability: float,
                generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """ids (B, L) corrupted with `generator`'s draws (seed 0 when None), labels (B, L) = original ids where
        picked, else -100."""
        tok = data.source_tokenizer
        specials = [i for i in (tok.bos_id, tok.eos_id, tok.unk_id) if i is not None]
        return collate_masked_lm(items, pad_id=tok.pad_id, mask_id=tok.mask_id, vocab_size=tok.vocab_size,
                                 special_ids=specials, probability=mlm_probability,
                                 generator=generator if generator is not None else torch.Generator().manual_seed(0))

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the N masked positions reach the vocabulary projection: logits (N, V), labels (N,)."""
        labels = batch["labels"]
        hidden = model.encode(batch["ids"])  # (B, L, d_model)
        keep = labels != -100
        return model.head(hidden[keep]), labels[keep]  # (N, V), (N,)


TASK = MaskedLM()
