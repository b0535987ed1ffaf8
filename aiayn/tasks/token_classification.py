"""Token classification (tagging): a tag per word from its first subword's state, scored by entity-level F1."""

from __future__ import annotations

from typing import Any

import torch

from aiayn.data.collate import IGNORE, collate_token_classification
from aiayn.data.prepare import EncodedSplit, PreparedData
from aiayn.data.readers import ReadStats, read_conll
from aiayn.tasks.base import Encoded, Shown, Task, label_ids
from aiayn.tasks.metrics import entity_f1
from aiayn.tasks.names import TOKEN_CLASSIFICATION
from aiayn.tokenization import Tokenizer


class TokenClassification(Task):
    """`<s>` ids `</s>` in, one of the data's tags per word out (other subwords and specials are ignored)."""

    name = TOKEN_CLASSIFICATION
    metrics = ("entity_f1", "loss")
    head = TOKEN_CLASSIFICATION
    loaded = "aiayn.inference.classifiers:Tagger"
    label_word = "tag"
    bert_keys = {"classifier": "head.classifier"}  # BertForTokenClassification's Linear on every position

    def read(self, cfg: Any, path: str) -> tuple[list, ReadStats]:
        """Tagged words (CoNLL: a word and its tag a line, a blank line between sentences)."""
        return read_conll(path)

    def texts(self, examples: list, side: str) -> list[str]:
        """The sentences, words joined by spaces."""
        return [" ".join(e.tokens) for e in examples]

    def label_names(self, train: list) -> list[str]:
        """Sorted tags of the training split."""
        return self.at_least_two(sorted({tag for e in train for tag in e.tags}))

    def encode(self, raw: list, source: Tokenizer, target: Tokenizer, labels: list[str], name: str) -> Encoded:
        """(`<s>` ids `</s>`, tag indices) items: a word's tag on its first subword, -100 on the others."""
        label_id = label_ids(labels, name)
        encoded = []
        for example in raw:
            enc = source.hf.encode(list(example.tokens), is_pretokenized=True, add_special_tokens=False)
            tags = [IGNORE]
            previous = None
            for word in enc.word_ids:
                tags.append(label_id(example.tags[word]) if word is not None and word != previous else IGNORE)
                previous = word
            encoded.append(([source.bos_id, *enc.ids, source.eos_id], [*tags, IGNORE]))
        return encoded, [(len(ids), 0) for ids, _ in encoded]

    def collate(self, data: PreparedData, items: list, *, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
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
