"""Sequence classification: one label per text from the pooled encoder states, scored by accuracy and macro-F1."""

from __future__ import annotations

from typing import Any

import torch

from aiayn.data.collate import collate_sequence_classification
from aiayn.data.prepare import EncodedSplit, PreparedData
from aiayn.tasks.base import Shown, Task
from aiayn.tasks.metrics import accuracy_and_macro_f1
from aiayn.tasks.names import SEQUENCE_CLASSIFICATION


class SequenceClassification(Task):
    """`<s>` ids `</s>` in, one of the data's labels out (the head pools the first token or the mean)."""

    name = SEQUENCE_CLASSIFICATION
    metrics = ("accuracy", "macro_f1", "loss")
    head = SEQUENCE_CLASSIFICATION
    labelled = True

    def collate(self, data: PreparedData, items: list, *, mlm_probability: float,
                generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """ids (B, L), labels (B,)."""
        return collate_sequence_classification(items, pad_id=data.source_tokenizer.pad_id)

    def predictions(self, logits: torch.Tensor, labels: torch.Tensor, indices: list[int]) -> dict[int, Any]:
        """The most likely label's index of each example."""
        return dict(zip(indices, logits.argmax(-1).tolist()))

    def score(self, data: PreparedData, split: EncodedSplit, predictions: dict[int, Any], *,
              bleu_tokenize: str = "auto") -> tuple[dict[str, Any], Shown]:
        """Accuracy and macro-F1 against the split's labels."""
        order = sorted(predictions)
        gold = [split.items[i][1] for i in order]
        scores = accuracy_and_macro_f1([predictions[i] for i in order], gold, len(data.labels))
        shown = [(split.raw[i].text, data.labels[predictions[i]], split.raw[i].label) for i in order]
        return scores, shown


TASK = SequenceClassification()
