"""Translation: an encoder-decoder trained with teacher forcing, scored by BLEU, chrF and exact match."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from aiayn.data.collate import collate_seq2seq
from aiayn.data.prepare import EncodedSplit, PreparedData
from aiayn.tasks.base import Shown, Task
from aiayn.tasks.metrics import translation_scores
from aiayn.tasks.names import SEQ2SEQ


class Seq2Seq(Task):
    """Source ids in, target ids out (section 3); predictions are decoded, not read from the logits."""

    name = SEQ2SEQ
    metrics = ("bleu", "chrf", "exact_match", "loss")
    encoder_decoder = True
    decodes = True

    def collate(self, data: PreparedData, items: list, *, mlm_probability: float,
                generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """src (B, S), tgt_in (B, T) = `<s>` + target, labels (B, T) = target + `</s>`."""
        tgt = data.target_tokenizer
        return collate_seq2seq(items, pad_id=data.source_tokenizer.pad_id, bos_id=tgt.bos_id, eos_id=tgt.eos_id)

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing on the shifted target; only the N real target tokens reach the vocabulary
        projection (the largest matrix; padding would waste it): logits (N, V), labels (N,)."""
        labels = batch["labels"]
        src_mask = model.source_mask(batch["src"])
        memory = model.encode(batch["src"], src_mask)  # (B, S, d_model)
        hidden = model.decode(batch["tgt_in"], memory, memory_mask=src_mask)  # (B, T, d_model)
        keep = labels != -100
        return model.head(hidden[keep]), labels[keep]  # (N, V), (N,)

    def score(self, data: PreparedData, split: EncodedSplit, predictions: dict[int, Any], *,
              bleu_tokenize: str = "auto") -> tuple[dict[str, Any], Shown]:
        """BLEU, chrF and exact match of the decoded translations (`predictions`: index -> text)."""
        order = sorted(predictions)
        hyps = [predictions[i] for i in order]
        refs = [split.raw[i].target for i in order]
        shown = [(split.raw[i].source, predictions[i], split.raw[i].target) for i in order]
        return translation_scores(hyps, refs, bleu_tokenize=bleu_tokenize), shown


TASK = Seq2Seq()
