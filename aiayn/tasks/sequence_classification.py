"""Sequence classification: one label per text from the pooled encoder states, scored by accuracy and macro-F1."""

from __future__ import annotations

from typing import Any

import torch

from aiayn.data.collate import collate_sequence_classification
from aiayn.data.prepare import EncodedSplit, PreparedData
from aiayn.data.readers import ReadStats, read_classification
from aiayn.tasks.base import Encoded, Shown, Task, label_ids
from aiayn.tasks.metrics import accuracy_and_macro_f1
from aiayn.tasks.names import SEQUENCE_CLASSIFICATION
from aiayn.tokenization import Tokenizer


class SequenceClassification(Task):
    """`<s>` ids `</s>` in, one of the data's labels out (the head pools the first token or the mean)."""

    name = SEQUENCE_CLASSIFICATION
    metrics = ("accuracy", "macro_f1", "loss")
    head = SEQUENCE_CLASSIFICATION
    loaded = "aiayn.inference.classifiers:Classifier"
    checked = True

    def read(self, cfg: Any, path: str) -> tuple[list, ReadStats]:
        """Labelled texts, by the config's text and label field names."""
        return read_classification(path, fmt=cfg.data_format, text_field=cfg.text_field, label_field=cfg.label_field)

    def texts(self, examples: list, side: str) -> list[str]:
        """The texts."""
        return [e.text for e in examples]

    def label_names(self, train: list) -> list[str]:
        """Sorted labels of the training split."""
        return self.at_least_two(sorted({e.label for e in train}))

    def encode(self, raw: list, source: Tokenizer, target: Tokenizer, labels: list[str], name: str) -> Encoded:
        """(`<s>` ids `</s>`, label index) items; a split none of whose labels the run knows is refused."""
        if raw and not {e.label for e in raw} & set(labels):
            seen = sorted({e.label for e in raw})
            raise ValueError(f"{name} split: none of its labels ({', '.join(map(repr, seen[:3]))}"
                             f"{', ...' if len(seen) > 3 else ''}) is one of the run's ({', '.join(labels)}): is "
                             f"this data for another kind of run? (this one is {self.name})")
        label_id = label_ids(labels, name)
        ids = source.encode_batch([e.text for e in raw], add_bos=True, add_eos=True)
        return [(i, label_id(e.label)) for i, e in zip(ids, raw)], [(len(i), 0) for i in ids]

    def collate(self, data: PreparedData, items: list, *, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
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
