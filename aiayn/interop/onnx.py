"""Export an aiayn encoder to ONNX (dynamic batch and length), runnable by ONNX Runtime.

The graph takes `input_ids`, `attention_mask` (1 = real token) and, when the model has
segment embeddings, `token_type_ids`, all int64 (B, L); it returns `last_hidden_state`
(B, L, d_model). It is exported with TorchScript tracing (`torch.onnx.export(dynamo=False)`):
the encoder's input checks and its fast path (no mask work when a batch has no padding) branch on
tensor values, which `torch.export` cannot capture (torch 2.13 stops at the mask check with
GuardOnDataDependentSymNode). Tracing with a padded example records the masked path, which is
correct for every input that has at least one real token per row.

The graph holds the model's `max_len` positions and no more: a longer input fails in ONNX Runtime (at the
positions' Add, "Attempting to broadcast an axis by a dimension other than 1"), as aiayn refuses it; the tokenizer
exported beside it truncates to `max_len`, as `Embedder` does, so what it gives always fits.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from aiayn.nn.model import EncoderModel, architecture_of
from aiayn.rundir import atomic_output

logger = logging.getLogger(__name__)
OPSET = 17


class _EncoderGraph(nn.Module):
    """The encoder with positional inputs, as the exported graph sees it."""

    def __init__(self, model: EncoderModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) ids, mask and segment ids -> (B, L, d_model)."""
        return self.model.encode(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


def export_onnx(model: EncoderModel, path: str | Path, *, opset: int = OPSET) -> Path:
    """Write `model`'s encoder as ONNX to `path` (a task head is not exported).

    Returns:
        The path written.
    """
    if architecture_of(model) != "encoder-only":
        raise ValueError(f"only encoder-only models export to ONNX here (this one is {architecture_of(model)})")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    was_training = model.training
    model.eval()
    # A padded example (one row shorter) so that tracing records the masked attention path.
    length = min(8, cfg.max_len)
    ids = torch.full((2, length), min(5, cfg.vocab_size - 1), dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, length // 2 :] = 0
    ids[1, length // 2 :] = cfg.pad_id
    names = ["input_ids", "attention_mask"]
    example: tuple[torch.Tensor, ...] = (ids, mask)
    if cfg.type_vocab_size:
        names.append("token_type_ids")
        example += (torch.zeros_like(ids),)
    axes = {name: {0: "batch", 1: "length"} for name in names}
    axes["last_hidden_state"] = {0: "batch", 1: "length"}
    try:
        with atomic_output(path) as tmp, warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # TracerWarnings about the recorded branch, expected
            torch.onnx.export(_EncoderGraph(model), example, str(tmp), input_names=names,
                              output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=opset,
                              dynamo=False, do_constant_folding=True)
    finally:
        model.train(was_training)
    logger.info("wrote %s (inputs %s)", path, ", ".join(names))
    return path
