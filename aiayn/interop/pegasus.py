"""Hugging Face `PegasusForConditionalGeneration` <- aiayn pre-LN `EncoderDecoderModel`: the pre-LN Transformer's home.

Pegasus is Marian's layers in pre-LN order (`x + Sublayer(LayerNorm(x))`, section 3.1's residual with
the norm moved first) with a final LayerNorm after each stack, as aiayn builds `norm_first=True`; the
same names (`self_attn`, `fc1`, `final_layer_norm`, ...), LayerNorm eps 1e-5, embeddings x sqrt(d_model)
(`scale_embedding=True`), no embedding LayerNorm, and the paper's sinusoidal positions in the split
layout (sines, then cosines) from position 0. So `aiayn.interop.marian` does the mapping (`to_split_layout`,
`copy_weights`) and this file only names the config. Pegasus has one vocabulary for both sides.

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
from aiayn.interop.marian import (
    ACTIVATIONS,
    copy_weights,
    layer_problems,
    plain_generation,
    save_translator,
    to_split_layout,
)
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
    start = cfg.pad_id if decoder_start_token_id is None else decoder_start_token_id
    return PegasusConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers,
        decoder_layers=cfg.n_decoder_layers, encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
        activation_function=ACTIVATIONS[cfg.activation], dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        max_position_embeddings=cfg.max_len, scale_embedding=cfg.scale_embeddings,
        tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, eos_token_id=eos_token_id,
        decoder_start_token_id=start, forced_eos_token_id=None, bos_token_id=None,
    )


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

    cfg: ModelConfig = model.config
    check_mappable(cfg)
    if cfg.pe_layout != "split":
        model = to_split_layout(model)
    hf = PegasusForConditionalGeneration(pegasus_config(cfg, decoder_start_token_id=decoder_start_token_id,
                                                        eos_token_id=eos_token_id)).eval()
    copy_weights(model, hf)
    plain_generation(hf, cfg, eos_token_id=eos_token_id)
    return hf


def export_pegasus(model: EncoderDecoderModel, tokenizer: Tokenizer, directory: str | Path, *,
                   beam_size: int = 4, length_penalty: float = 0.6) -> Path:
    """Write a trained pre-LN translator as a Hugging Face Pegasus model and tokenizer into `directory`.

    `PegasusForConditionalGeneration.from_pretrained(directory)` (or `AutoModelForSeq2SeqLM`) and
    `AutoTokenizer.from_pretrained(directory)` load it; the decoder starts from `<s>` as in training,
    and `generate()` defaults to the search of `aiayn translate` (beam 4, length penalty 0.6, early stopping).
    """
    hf = to_pegasus(model, decoder_start_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    return save_translator(hf, tokenizer, tokenizer, directory, max_len=model.config.max_len,
                           beam_size=beam_size, length_penalty=length_penalty)
