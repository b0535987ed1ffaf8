"""Batches of a split and the loss's inputs, as the objective's task object (`aiayn.tasks`) makes them.

`make_batch` collates a list of example indices of a split; `forward` returns logits and the
labels they are scored against (-100 = ignored); the seeds and counts of a batch are here too.
"""

from __future__ import annotations

import torch
from torch import nn

from aiayn.data.prepare import EncodedSplit, PreparedData
from aiayn.tasks import get_task


def batch_seed(seed: int, epoch: int, batch_index: int, *, stream: int = 0) -> int:
    """The seed of one batch's randomness, fixed by (seed, epoch, batch): the same in a resumed run and in
    whichever process trains the batch. `stream` keeps masking (0) and dropout (1) draws apart."""
    return seed * 1_000_003 + epoch * 100_003 + batch_index + (stream << 48)


def masking_generator(seed: int, epoch: int, batch_index: int) -> torch.Generator:
    """A generator for masked-LM corruption fixed by (seed, epoch, batch): resumed runs mask the same way."""
    return torch.Generator().manual_seed(batch_seed(seed, epoch, batch_index))


def make_batch(data: PreparedData, split: EncodedSplit, indices: list[int], *, mlm_probability: float = 0.15,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Collate the examples `indices` of `split` as the data's objective does (`aiayn.tasks`)."""
    items = [split.items[i] for i in indices]
    return get_task(data.objective).collate(data, items, mlm_probability=mlm_probability, generator=generator)


def forward(model: nn.Module, batch: dict[str, torch.Tensor], objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, labels) of one batch, as the objective's task object computes them (`aiayn.tasks`).

    Seq2seq and masked-LM project to the vocabulary only the positions the loss counts
    (N = real target tokens or masked tokens), returning logits (N, V) and labels (N,).
    """
    return get_task(objective).forward(model, batch)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's tensors on `device` (collation builds them on the CPU)."""
    return {name: t.to(device, non_blocking=True) for name, t in batch.items()}


def batch_tokens(batch: dict[str, torch.Tensor], pad_id: int) -> int:
    """Real (non-pad) input tokens in a batch, for tokens/s."""
    if "src" in batch:
        return int((batch["src"] != pad_id).sum() + (batch["labels"] != -100).sum())
    return int((batch["ids"] != pad_id).sum())


def loss_units(batch: dict[str, torch.Tensor]) -> int:
    """Positions the loss counts in a batch (target tokens, masked tokens, or sequences)."""
    return int((batch["labels"] != -100).sum())
