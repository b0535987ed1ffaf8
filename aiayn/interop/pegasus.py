"""Hugging Face `PegasusForConditionalGeneration` <- aiayn pre-LN `EncoderDecoderModel`: the pre-LN Transformer's home.

Pegasus is Marian's layers in pre-LN order (`x + Sublayer(LayerNorm(x))`, section 3.1's residual with
the norm moved first) with a final LayerNorm after each stack, as aiayn builds `norm_first=True`; the
same names (`self_attn`, `fc1`, `final_layer_norm`, ...), LayerNorm eps 1e-5, embeddings x sqrt(d_model)
(`scale_embedding=True`), no embedding LayerNorm, and the paper's sinusoidal positions in the split
layout (sines, then cosines) from position 0. So `aiayn.interop.marian` does the mapping (`hf_translator`,
`translator_fields`) and this file only names the model and what it cannot hold. Pegasus has one vocabulary
for both sides.

Why not M2M100 (the other pre-LN translator in transformers): its positions are fairseq's table,
sin(p * 10000^(-i / (d_model/2 - 1))) rather than the paper's 10000^(-i / (d_model/2)), and start at
`padding_idx + 1`; the table is recomputed on load, not stored, and differs from the paper's in its
values, not in an order a permutation of d_model could absorb. No weight of an M2M100 checkpoint can
carry aiayn's positions.
"""

from __future__ import annotations

from pathlib import Path

import torch

from aiayn.config import ModelConfig
from aiayn.interop.marian import hf_translator, layer_problems, save_translator, translator_fields
from aiayn.nn.model import EncoderDecoderModel
from aiayn.tokenization import Tokenizer


def check_mappable(cfg: ModelConfig) -> None:
    """ValueError naming every option of `cfg` that Pegasus cannot express."""
    problems = layer_problems(cfg, "Pegasus")
    if not cfg.norm_first:
        problems.insert(0, "Pegasus is pre-LN (export a post-LN model as Marian)")
    if not cfg.share_embeddings:
        problems.append("Pegasus has one vocabulary for source and target (train with shared_vocab=true)")
    if problems:
        raise ValueError("model cannot be mapped to Pegasus: " + "; ".join(problems))


def pegasus_config(cfg: ModelConfig, *, decoder_start_token_id: int | None = None, eos_token_id: int = 2):
    """The `PegasusConfig` of an aiayn config; the decoder starts from `<pad>` unless told otherwise."""
    from transformers import PegasusConfig

    check_mappable(cfg)
    return PegasusConfig(**translator_fields(cfg, decoder_start_token_id=decoder_start_token_id,
                                             eos_token_id=eos_token_id))


@torch.no_grad()
def to_pegasus(model: EncoderDecoderModel, *, decoder_start_token_id: int | None = None, eos_token_id: int = 2):
    """A `transformers.PegasusForConditionalGeneration` (eval mode) with `model`'s weights, plain generation.

    Args:
        model: an aiayn pre-LN encoder-decoder (`norm_first=True`, sinusoidal positions, one vocabulary);
            the interleaved layout is moved to the split one first (`to_split_layout`).
        decoder_start_token_id: the first decoder input; None means `<pad>`, as Pegasus does. Pass
            `<s>` for a model trained by `aiayn train`, whose targets start with `<s>`.
        eos_token_id: the end-of-sentence id (aiayn's `</s>` is 2).
    """
    from transformers import PegasusForConditionalGeneration

    config = pegasus_config(model.config, decoder_start_token_id=decoder_start_token_id, eos_token_id=eos_token_id)
    return hf_translator(model, PegasusForConditionalGeneration, config, eos_token_id=eos_token_id)


def export_pegasus(model: EncoderDecoderModel, tokenizer: Tokenizer, directory: str | Path, *,
                   num_beams: int = 4, length_penalty: float = 0.6) -> Path:
    """Write a trained pre-LN translator as a Hugging Face Pegasus model and tokenizer into `directory`.

    `PegasusForConditionalGeneration.from_pretrained(directory)` (or `AutoModelForSeq2SeqLM`) and
    `AutoTokenizer.from_pretrained(directory)` load it; the decoder starts from `<s>` as in training,
    and `generate()` defaults to the search of `aiayn translate` (beam 4, length penalty 0.6, Hugging Face's stopping
    rule).
    """
    hf = to_pegasus(model, decoder_start_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    return save_translator(hf, tokenizer, tokenizer, directory, max_len=model.config.max_len,
                           num_beams=num_beams, length_penalty=length_penalty)
