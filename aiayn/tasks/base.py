"""What every task object answers; the defaults are an encoder objective scored on the logits themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # imported for hints only: the data layer is imported by the task files, not by the registry
    from aiayn.data.prepare import EncodedSplit, PreparedData

Shown = list[tuple[str, str, str]]  # (input, prediction, reference) triples an evaluation shows


class Task:
    """One training objective.

    Attributes:
        name: the objective's name (`names.py`), as run configs store it.
        metrics: the validation metrics it reports; the first is `valid_metric=auto`'s choice.
        head: the `ModelConfig.head` it trains ("none" for the encoder-decoder's vocabulary projection).
        labelled: whether the head ends in one logit per label of the data (`num_labels = len(data.labels)`).
        encoder_decoder: whether it trains the encoder-decoder (else an encoder with `head`).
        decodes: whether its predictions are generated (beam search) rather than read from the logits.
    """

    name: str = ""
    metrics: tuple[str, ...] = ("loss",)
    head: str = "none"
    labelled: bool = False
    encoder_decoder: bool = False
    decodes: bool = False

    def collate(self, data: PreparedData, items: list, *, mlm_probability: float,
                generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """Padded tensors of encoded `items` (see `aiayn.data.collate`); always with `labels` (-100 = ignored)."""
        raise NotImplementedError

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, labels) the loss compares: here the model's output on `ids` against the batch's labels."""
        return model(batch["ids"]), batch["labels"]

    def predictions(self, logits: torch.Tensor, labels: torch.Tensor, indices: list[int]) -> dict[int, Any]:
        """Each example's prediction, by its index in the split (none for objectives scored on loss alone)."""
        return {}

    def score(self, data: PreparedData, split: EncodedSplit, predictions: dict[int, Any], *,
              bleu_tokenize: str = "auto") -> tuple[dict[str, Any], Shown]:
        """(metrics, shown examples) of `predictions` against the split's references, in index order."""
        return {}, []
