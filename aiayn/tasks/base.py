"""What every task object answers; the defaults are an encoder objective scored on the logits themselves."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # imported for hints only: the data layer is imported by the task files, not by the registry
    from aiayn.data.prepare import EncodedSplit, PreparedData
    from aiayn.data.readers import ReadStats
    from aiayn.tokenization import Tokenizer

Shown = list[tuple[str, str, str]]  # (input, prediction, reference) triples an evaluation shows
Encoded = tuple[list, list[tuple[int, int]]]  # (encoded items, (source, target) length of each)


class Task(abc.ABC):
    """One training objective.

    Attributes:
        name: the objective's name (`names.py`), as run configs store it.
        metrics: the validation metrics it reports; the first is `valid_metric=auto`'s choice.
        head: the `ModelConfig.head` it trains ("none" for the encoder-decoder's vocabulary projection).
        labelled: whether the head ends in one logit per label of the data (`num_labels = len(data.labels)`).
        encoder_decoder: whether it trains the encoder-decoder (else an encoder with `head`).
        decodes: whether its predictions are generated (beam search) rather than read from the logits.
        checked: whether its data files pass the data check (`aiayn.data.check`: pairs and labelled texts).
        label_word: what one of its labels is called in messages ("label", "tag").
    """

    name: str = ""
    metrics: tuple[str, ...] = ("loss",)
    head: str = "none"
    labelled: bool = False
    encoder_decoder: bool = False
    decodes: bool = False
    checked: bool = False
    label_word: str = "label"
    special_tokens: tuple[str, ...] = ()  # tokens its tokenizer must hold besides the usual ones
    # Hugging Face BERT names of its head's weights -> aiayn's (`aiayn.interop.bert`): whole keys, or stems
    # whose `.weight` / `.bias` follow. A head without them is newly initialised when a checkpoint loads.
    bert_keys: dict[str, str] = {}

    # -- the data side (aiayn.data.prepare calls these) -------------------------------------------
    @abc.abstractmethod
    def read(self, cfg: Any, path: str) -> tuple[list, ReadStats]:
        """The examples of one data file, by the run config's format and field names."""

    def texts(self, examples: list, side: str) -> list[str]:
        """The texts a tokenizer learns from (`side`: "source" or "target")."""
        return list(examples)

    def label_names(self, train: list) -> list[str]:
        """Sorted label (or tag) names seen in the training split (none for unlabelled objectives)."""
        return []

    @abc.abstractmethod
    def encode(self, raw: list, source: Tokenizer, target: Tokenizer, labels: list[str], name: str) -> Encoded:
        """Token ids of the examples of split `name` (`labels`: the run's label names, their index the id)."""

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Raise ValueError when `tokenizer` lacks what the objective needs (nothing, by default)."""
        return None

    # -- the model side ----------------------------------------------------------------------------
    @abc.abstractmethod
    def collate(self, data: PreparedData, items: list, *, mlm_probability: float,
                generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """Padded tensors of encoded `items` (see `aiayn.data.collate`); always with `labels` (-100 = ignored)."""

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


def label_ids(labels: list[str], name: str) -> Callable[[str], int]:
    """The index of a label name among `labels`; ValueError names a label the training data lacks."""
    index = {label: i for i, label in enumerate(labels)}

    def label_id(label: str) -> int:
        if label not in index:
            raise ValueError(f"{name} split: label {label!r} does not occur in the training data "
                             f"(known: {', '.join(labels)})")
        return index[label]

    return label_id
