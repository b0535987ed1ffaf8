"""Masked language modelling (BERT's pre-training): predict corrupted tokens; scored on loss alone."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from aiayn.data.collate import collate_masked_lm
from aiayn.data.prepare import PreparedData
from aiayn.data.readers import ReadStats, read_text
from aiayn.tasks.base import Encoded, Task
from aiayn.tasks.names import MASKED_LM
from aiayn.tokenization import MASK, Tokenizer


class MaskedLM(Task):
    """Corrupted ids in, the original ids at the picked positions out (80% `<mask>`, 10% random, 10% kept)."""

    name = MASKED_LM
    head = MASKED_LM
    special_tokens = (MASK,)
    bert_keys = {  # BertForMaskedLM's `cls.predictions`; the vocabulary bias sits outside its Linear there
        "cls.predictions.transform.dense": "head.dense",
        "cls.predictions.transform.LayerNorm": "head.norm",
        "cls.predictions.decoder": "head.proj",
        "cls.predictions.bias": "head.proj.bias",
    }

    def __init__(self, probability: float = 0.15):
        self.probability = probability  # the share of real tokens picked (BERT's 0.15)

    def trains(self, cfg: Any) -> bool:
        """An encoder with the masked-LM head, or with none (the plain encoder pre-training leaves)."""
        return not cfg.n_decoder_layers and not cfg.causal and cfg.head in (MASKED_LM, "none")

    def configured(self, cfg: Any) -> MaskedLM:
        """The task masking the run's `mlm_probability` of the tokens."""
        return self if cfg.mlm_probability == self.probability else MaskedLM(cfg.mlm_probability)

    def read(self, cfg: Any, path: str) -> tuple[list, ReadStats]:
        """Plain text, one example a line."""
        return read_text(path)

    def encode(self, raw: list, source: Tokenizer, target: Tokenizer, labels: list[str], name: str) -> Encoded:
        """`<s>` ids `</s>` of each line (collation masks them)."""
        ids = source.encode_batch(list(raw), add_bos=True, add_eos=True)
        return ids, [(len(i), 0) for i in ids]

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Masking needs the tokenizer's mask token."""
        if tokenizer.mask_id is None:
            raise ValueError("masked-LM training needs a tokenizer with a mask token")

    def collate(self, data: PreparedData, items: list, *, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """ids (B, L), `probability` of their real tokens corrupted with `generator`'s draws (seed 0 when None),
        labels (B, L) = original ids where picked, else -100."""
        tok = data.source_tokenizer
        specials = [i for i in (tok.bos_id, tok.eos_id, tok.unk_id) if i is not None]
        return collate_masked_lm(items, pad_id=tok.pad_id, mask_id=tok.mask_id, vocab_size=tok.vocab_size,
                                 special_ids=specials, probability=self.probability,
                                 generator=generator if generator is not None else torch.Generator().manual_seed(0))

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the N masked positions reach the vocabulary projection: logits (N, V), labels (N,)."""
        labels = batch["labels"]
        hidden = model.encode(batch["ids"])  # (B, L, d_model)
        keep = labels != -100
        return model.head(hidden[keep]), labels[keep]  # (N, V), (N,)


TASK = MaskedLM()
