"""`Classifier` (a label per text) and `Tagger` (a tag per word): what classification and tagging runs predict.

Texts are encoded as in training (`aiayn.data.prepare`): `<s>` ids `</s>`; a text longer than the model's
`max_len` is refused unless `truncate=True` cuts it (as translation does). A tagger splits a text at whitespace
into words and reads each word's tag on its first subword. Label names come from the run's `labels.json`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aiayn.data.collate import pad
from aiayn.inference import threads
from aiayn.inference.embeddings import encode_texts, length_sorted_batches, pass_cost
from aiayn.inference.runner import ModelRunner, check_vocabulary, encoding_threads, text_list, too_long
from aiayn.tasks import SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION
from aiayn.tokenization import Tokenizer


@dataclass
class Prediction:
    """A text's label, its probability, and every label's probability (summing to 1)."""

    label: str
    score: float
    scores: dict[str, float]


@dataclass
class WordTag:
    """One word of a text, its tag and the tag's probability; words cut off by `max_len` get tag None."""

    word: str
    tag: str | None
    score: float


class _LabelledModel(ModelRunner):
    """An encoder with a classification head, its tokenizer and its label names."""

    head_kind = ""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, labels: Sequence[str] | None = None, *,
                 device: str | torch.device | None = None, precision: str = "fp32", plain: bool = False):
        cfg = model.config
        if cfg.head != self.head_kind:
            raise ValueError(f"a {type(self).__name__} needs a {self.head_kind} model; this one has head {cfg.head!r}")
        labels = list(labels) if labels else [f"LABEL_{i}" for i in range(cfg.num_labels)]
        if len(labels) != cfg.num_labels:
            raise ValueError(f"{len(labels)} label names (labels.json) for a model with num_labels {cfg.num_labels} "
                             "(config.json): they come from different runs; save them together again")
        check_vocabulary(tokenizer, cfg.vocab_size, "vocab_size")
        super().__init__(model, device=device, precision=precision, plain=plain)
        self.tokenizer = tokenizer
        self.labels = labels

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: str | torch.device | None = None,
                        precision: str = "fp32"):
        """The object of a run or model directory (config.json, model.safetensors, tokenizer, labels.json)."""
        from aiayn.data.prepare import load_labels
        from aiayn.io import load_model, load_tokenizers

        return cls(load_model(directory), load_tokenizers(directory)[0], load_labels(directory), device=device,
                   precision=precision)

    def save_pretrained(self, directory: str | Path, *, force: bool = False) -> Path:
        """Write model, tokenizer and `labels.json` where `from_pretrained` reads them (a new or empty
        directory, or one aiayn saved before, unless `force`)."""
        from aiayn.io import save_model
        from aiayn.rundir import LABELS, atomic_write_text, claim_for_export

        directory = claim_for_export(directory, force=force, fmt="aiayn", option="directory",
                                     force_hint="pass force=True")
        save_model(self.model, directory, tokenizer=self.tokenizer)
        atomic_write_text(directory / LABELS, json.dumps(self.labels, indent=2) + "\n")
        return directory

    def _each_batch(self, rows: list[list[int]], batch_size: int,
                    use: Callable[[list[int], torch.Tensor], None]) -> None:
        """`use(batch, logits)` for each batch of id rows (`batch`: indices into `rows`, longest batch first; logits
        as the head gives them, in float32), one call at a time; the batches run as `ModelRunner.run_batches` runs
        them (checked to fit first; side by side where they gain)."""
        lengths = [len(row) for row in rows]
        batches = length_sorted_batches(lengths, batch_size, pass_cost(self.device))  # refuses a batch_size under 1
        prepared, pad_id = self.prepared_model(), self.tokenizer.pad_id
        told = threading.Lock()

        def run(batch: list[int]) -> None:
            ids = pad([rows[i] for i in batch], pad_id).to(self.device)  # (B, L)
            mask = pad([[1] * lengths[i] for i in batch], 0).to(self.device)  # (B, L), 1 = real token
            with torch.inference_mode(), threads.running_on(encoding_threads(prepared, ids)):
                logits = prepared(ids, attention_mask=mask).float()
            with told:
                use(batch, logits)

        self.run_batches(run, batches, lengths, "a smaller batch_size (--batch-size)")


class Classifier(_LabelledModel):
    """Texts -> a label each, with probabilities (a `sequence_classification` model)."""

    head_kind = SEQUENCE_CLASSIFICATION

    def probabilities(self, texts: Sequence[str], *, batch_size: int = 32, truncate: bool = False) -> np.ndarray:
        """(N, num_labels) float32 probabilities, rows in the order of `texts`, columns in that of `labels`.

        A text longer than the model's `max_len` raises ValueError, unless `truncate` cuts it (as training did)."""
        rows = encode_texts(self.tokenizer, text_list(texts), self.model.config.max_len, truncate=truncate)
        out = np.zeros((len(rows), len(self.labels)), dtype=np.float32)

        def use(batch: list[int], logits: torch.Tensor) -> None:
            out[batch] = logits.softmax(dim=-1).cpu().numpy()  # (B, num_labels)

        self._each_batch(rows, batch_size, use)
        return out

    def predict(self, texts: str | Sequence[str], *, batch_size: int = 32,
                truncate: bool = False) -> Prediction | list[Prediction]:
        """The most likely label of each text (one string gives one `Prediction`); `truncate` as `probabilities`."""
        single = isinstance(texts, str)
        probs = self.probabilities(text_list(texts), batch_size=batch_size, truncate=truncate)
        out = [Prediction(self.labels[int(row.argmax())], float(row.max()),
                          {label: float(p) for label, p in zip(self.labels, row)}) for row in probs]
        return out[0] if single else out


class Tagger(_LabelledModel):
    """Texts -> a tag per whitespace-separated word, with its probability (a `token_classification` model)."""

    head_kind = TOKEN_CLASSIFICATION

    def _encode(self, words: list[str], number: int, truncate: bool) -> tuple[list[int], list[int]]:
        """`<s>` ids `</s>` of the words of text `number` (cut to `max_len` where `truncate`, else a ValueError) and
        the position of each word's first subword."""
        tok, limit = self.tokenizer, self.model.config.max_len
        if not words:
            return [tok.bos_id, tok.eos_id], []
        enc = tok.hf.encode(words, is_pretokenized=True, add_special_tokens=False)
        if len(enc.ids) + 2 > limit and not truncate:
            raise too_long(number, len(enc.ids) + 2, limit)
        ids = [tok.bos_id, *enc.ids[: limit - 2], tok.eos_id]
        firsts, previous = [], None
        for position, word in enumerate(enc.word_ids[: limit - 2], start=1):
            if word is not None and word != previous:
                firsts.append(position)
            previous = word
        return ids, firsts

    def predict(self, texts: str | Sequence[str], *, batch_size: int = 32,
                truncate: bool = False) -> list[WordTag] | list[list[WordTag]]:
        """The tag of every word of each text (one string gives one list). A text longer than the model's `max_len`
        raises ValueError, unless `truncate` cuts it (its last words then get tag None)."""
        single = isinstance(texts, str)
        texts = text_list(texts)
        words = [text.split() for text in texts]
        encoded = [self._encode(w, number, truncate) for number, w in enumerate(words, start=1)]
        out: list[list[WordTag]] = [[] for _ in texts]

        def use(batch: list[int], logits: torch.Tensor) -> None:
            probs = logits.softmax(dim=-1).cpu()  # (B, L, num_labels)
            for row, i in enumerate(batch):
                firsts = encoded[i][1]
                best, index = probs[row, firsts].max(dim=-1) if firsts else (torch.zeros(0), torch.zeros(0))
                tagged = [WordTag(w, self.labels[int(t)], float(p)) for w, t, p in zip(words[i], index, best)]
                out[i] = tagged + [WordTag(w, None, 0.0) for w in words[i][len(tagged):]]

        self._each_batch([ids for ids, _ in encoded], batch_size, use)
        return out[0] if single else out
