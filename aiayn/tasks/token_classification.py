"""Token classification (tagging): a tag per word from its first subword's state, scored by entity-level F1."""

from __future__ import annotations

from typing import Any

import torch

from aiayn.data.collate import collate_token_classification
from aiayn.data.prepare import EncodedSplit, PreparedData
from aiayn.tasks.base import Shown, Task
from aiayn.tasks.metrics import entity_f1
from aiayn.tasks.names import TOKEN_CLASSIFICATION


class TokenClassification(Task):
    """`<s>` ids `</s>` in, one of the data's tags per word out (other subwords and specials are ignored)."""

    name = TOKEN_CLASSIFICATION
    metrics = ("entity_f1", "loss")
    head = TOKEN_CLASSIFICATION
    labelled = True

    def collate(self, data: PreparedData, items: list, *, mlm_probability: float,
                generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """ids (B, L), labels (B, L) with -100 where no word starts."""
        return collate_token_classification(items, pad_id=data.source_tokenizer.pad_id)

    def predictions(self, logits: torch.Tensor, labels: torch.Tensor, indices: list[int]) -> dict[int, Any]:
        """Each example's predicted tag indices at the positions its labels count (one per word)."""
        out = {}
        for row, i in enumerate(indices):
            keep = labels[row] != -100
            out[i] = logits[row].argmax(-1)[keep].tolist()
        return out

    def score(self, data: PreparedData, split: EncodedSplit, predictions: dict[int, Any], *,
              bleu_tokenize: str = "auto") -> tuple[dict[str, Any], Shown]:
        """Entity precision, recall and F1 of the predicted tags against the split's (BIO spans)."""
        order = sorted(predictions)
        pred_tags = [[data.labels[t] for t in predictions[i]] for i in order]
        gold_tags = [list(split.raw[i].tags[: len(predictions[i])]) for i in order]
        shown = [(" ".join(split.raw[i].tokens), " ".join(p), " ".join(g))
                 for i, p, g in zip(order, pred_tags, gold_tags)]
        return entity_f1(pred_tags, gold_tags), shown


TASK = TokenClassification()
