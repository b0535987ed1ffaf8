"""Autoregressive generation for encoder-decoder models.

Stable API (the decoding strategies grow behind it): `generate(model, src, bos_id=..., eos_id=..., config=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aiayn.nn.model import EncoderDecoderModel


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings; the paper used beam 4, alpha 0.6, max length = source length + 50 (section 6.1)."""

    max_len: int | None = None
    extra_len: int = 50
    min_len: int = 0
    beam_size: int = 1
    length_penalty: float = 0.6
    early_stopping: bool = True
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class GenerationOutput:
    """Generated ids per sentence (no `<s>`, no `</s>`) and their log-probability scores (B,)."""

    tokens: list[list[int]]
    scores: torch.Tensor
    attention: list | None = None


@torch.no_grad()
def generate(model: EncoderDecoderModel, src: torch.Tensor, *, bos_id: int, eos_id: int,
             config: GenerationConfig | None = None) -> GenerationOutput:
    """Decode source ids (B, S) greedily with the key/value cache."""
    config = config or GenerationConfig()
    model.eval()
    batch = src.shape[0]
    src_mask = model.source_mask(src)
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    max_len = config.max_len if config.max_len is not None else src.shape[1] + config.extra_len
    cache = model.new_cache()
    next_input = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    scores = torch.zeros(batch, device=src.device)
    out: list[list[int]] = [[] for _ in range(batch)]
    for _ in range(max_len):
        hidden = model.decode(next_input, memory, memory_mask=src_mask, cache=cache)  # (B, 1, d_model)
        log_probs = model.generator.log_probs(hidden[:, -1])  # (B, V)
        best = log_probs.argmax(dim=-1)  # (B,)
        scores += torch.where(finished, 0.0, log_probs.gather(1, best[:, None])[:, 0])
        for i in range(batch):
            if not finished[i] and int(best[i]) != eos_id:
                out[i].append(int(best[i]))
        finished |= best == eos_id
        if bool(finished.all()):
            break
        next_input = best[:, None]
    return GenerationOutput(tokens=out, scores=scores)
