"""Translation: an encoder-decoder trained with teacher forcing, scored by BLEU, chrF and exact match."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aiayn.data.collate import collate_seq2seq
from aiayn.data.prepare import EncodedSplit, PreparedData
from aiayn.data.readers import ReadStats, read_parallel
from aiayn.tasks.base import Encoded, Shown, Task
from aiayn.tasks.metrics import translation_scores
from aiayn.tasks.names import SEQ2SEQ
from aiayn.tokenization import Tokenizer


class Seq2Seq(Task):
    """Source ids in, target ids out (section 3); predictions are decoded, not read from the logits."""

    name = SEQ2SEQ
    metrics = ("bleu", "chrf", "exact_match", "loss")
    text_sides = ("source", "target")
    starts_from_encoder = False
    generates = True
    checked = True
    fits_recipe = True
    loaded = "aiayn.inference.translator:Translator"
    exporter = "aiayn.export:export_translator"

    def trains(self, cfg: Any) -> bool:
        return bool(cfg.has_cross_attention)

    def read(self, cfg: Any, path: str) -> tuple[list, ReadStats]:
        """Sentence pairs: two aligned files "SRC,TGT", or one file with source and target fields."""
        return read_parallel(path, fmt=cfg.data_format, source_field=cfg.source_field, target_field=cfg.target_field)

    def texts(self, examples: list, side: str) -> list[str]:
        """The source or the target sentences."""
        return [e.source if side == "source" else e.target for e in examples]

    def encode(self, raw: list, source: Tokenizer, target: Tokenizer, labels: list[str], name: str) -> Encoded:
        """(source ids + `</s>`, target ids) pairs; the target's length counts the `</s>` collation adds."""
        src_ids = source.encode_batch([e.source for e in raw], add_eos=True)
        tgt_ids = target.encode_batch([e.target for e in raw])
        encoded = list(zip(src_ids, tgt_ids))
        return encoded, [(len(s), len(t) + 1) for s, t in encoded]

    def model_settings(self, data: PreparedData, given: dict[str, Any]) -> dict[str, Any]:
        """The encoder-decoder of the preset; a target vocabulary of its own when the data has two tokenizers."""
        if given.get("n_decoder_layers", 1) == 0:
            raise ValueError("seq2seq needs n_decoder_layers > 0")
        if data.shared_tokenizer:
            return {}
        return {"tgt_vocab_size": data.target_tokenizer.vocab_size, "share_embeddings": False}

    def shape_before_data(self, train: Any) -> dict[str, Any]:
        """The preset's encoder-decoder; a target vocabulary of the size the run asks for where it asks for two."""
        if train.shared_vocab:
            return {}
        return {"tgt_vocab_size": train.target_vocab_size or train.vocab_size, "share_embeddings": False}

    def collate(self, data: PreparedData, items: list, *, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """src (B, S), tgt_in (B, T) = `<s>` + target, labels (B, T) = target + `</s>`."""
        tgt = data.target_tokenizer
        return collate_seq2seq(items, pad_id=data.source_tokenizer.pad_id, bos_id=tgt.bos_id, eos_id=tgt.eos_id)

    def batch_tokens(self, batch: dict[str, torch.Tensor], pad_id: int) -> int:
        """Real source tokens and target tokens."""
        return int((batch["src"] != pad_id).sum() + (batch["labels"] != -100).sum())

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing on the shifted target; only the N real target tokens reach the vocabulary
        projection (the largest matrix; padding would waste it): logits (N, V), labels (N,)."""
        labels = batch["labels"]
        src_mask = model.source_mask(batch["src"])
        memory = model.encode(batch["src"], src_mask)  # (B, S, d_model)
        hidden = model.decode(batch["tgt_in"], memory, memory_mask=src_mask)  # (B, T, d_model)
        keep = labels != -100
        return model.head(hidden[keep]), labels[keep]  # (N, V), (N,)

    def decode(self, model: nn.Module, data: PreparedData, batch: dict[str, torch.Tensor], indices: list[int],
               search: Callable[..., list[list[int]]]) -> dict[int, Any]:
        """The translations `search` generates from the batch's sources."""
        tgt = data.target_tokenizer
        tokens = search(model, batch["src"], bos_id=tgt.bos_id, eos_id=tgt.eos_id)
        return {i: tgt.decode(row) for i, row in zip(indices, tokens)}

    def score(self, data: PreparedData, split: EncodedSplit, predictions: dict[int, Any], *,
              bleu_tokenize: str = "auto") -> tuple[dict[str, Any], Shown]:
        """BLEU, chrF and exact match of the decoded translations (`predictions`: index -> text)."""
        order = sorted(predictions)
        hyps = [predictions[i] for i in order]
        refs = [split.raw[i].target for i in order]
        shown = [(split.raw[i].source, predictions[i], split.raw[i].target) for i in order]
        return translation_scores(hyps, refs, bleu_tokenize=bleu_tokenize), shown


TASK = Seq2Seq()
