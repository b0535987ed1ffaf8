"""Batches of a split as the objective's task object (`aiayn.tasks`) collates them, and their seeds and counts.

`make_batch` collates a list of example indices of a split; `forward` returns logits and the labels they are
scored against (-100 = ignored).
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
    """A generator for a batch's random corruption (masked LM) fixed by (seed, epoch, batch): resumed runs draw the
    same."""
    return torch.Generator().manual_seed(batch_seed(seed, epoch, batch_index))


def make_batch(data: PreparedData, split: EncodedSplit, indices: list[int], *,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Collate the examples `indices` of `split` as the data's task does (`aiayn.tasks`)."""
    return data.task.collate(data, [split.items[i] for i in indices], generator=generator)


def forward(model: nn.Module, batch: dict[str, torch.Tensor], objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, labels) of one batch, as the objective's task object computes them (`Task.forward`)."""
    return get_task(objective).forward(model, batch)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's tensors on `device` (collation builds them on the CPU)."""
    return {name: t.to(device, non_blocking=True) for name, t in batch.items()}


def loss_units(batch: dict[str, torch.Tensor]) -> int:
    """Positions the loss counts in a batch (target tokens, masked tokens, or sequences)."""
    return int((batch["labels"] != -100).sum())
