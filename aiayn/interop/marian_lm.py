"""Hugging Face `MarianForCausalLM` <- aiayn `DecoderOnlyModel`: the paper's decoder used alone.

GPT-2 holds a pre-LN decoder with an unscaled embedding; the paper's decoder is post-LN, adds static sinusoids
and scales the embedding its head shares by sqrt(d_model). That decoder is Marian's (`aiayn.interop.marian`):
`MarianForCausalLM` is Marian's decoder stack with a vocabulary head and no encoder, so a decoder-only model of the
paper's shape (`recipe=paper`) exports there, weight for weight. Marian's decoder layers also carry a
cross-attention, which runs only when an encoder's states are given: a language model never gives them, and
its weights stay as `transformers` initialises them. The interleaved sinusoids move to Marian's split layout as
a translator's do (`to_split_layout`: a permutation of the d_model basis every weight absorbs).
"""

from __future__ import annotations

from pathlib import Path

import torch

from aiayn.config import ModelConfig
from aiayn.interop.hf_tokenizer import save_hf_tokenizer
from aiayn.interop.marian import _ATTENTION, ACTIVATIONS, stack_problems, to_split_layout
from aiayn.nn.model import DecoderOnlyModel
from aiayn.rundir import atomic_files
from aiayn.tokenization import Tokenizer


def marian_lm_problems(cfg: ModelConfig) -> list[str]:
    """What keeps a decoder-only config from `MarianForCausalLM`, each with its fix (empty when it maps)."""
    problems = []
    if not cfg.causal:
        problems.append("MarianForCausalLM is a decoder-only language model (causal=true)")
    if cfg.norm_first:
        problems.append("Marian is post-LN (a pre-LN model exports as GPT-2)")
    problems += stack_problems(cfg, "Marian")
    if cfg.activation not in ACTIVATIONS:
        problems.append(f"Marian has no activation {cfg.activation!r} (one of {', '.join(ACTIVATIONS)})")
    return problems


def marian_lm_config(cfg: ModelConfig, *, bos_token_id: int | None, eos_token_id: int | None):
    """The `MarianConfig` of a decoder-only config that `MarianForCausalLM` holds (ValueError when it does not)."""
    from transformers import MarianConfig

    problems = marian_lm_problems(cfg)
    if problems:
        raise ValueError("model cannot be mapped to MarianForCausalLM: " + "; ".join(problems))
    return MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.d_model, encoder_layers=0,
        decoder_layers=cfg.n_encoder_layers, decoder_attention_heads=cfg.n_heads, encoder_attention_heads=cfg.n_heads,
        decoder_ffn_dim=cfg.d_ff, encoder_ffn_dim=cfg.d_ff, activation_function=ACTIVATIONS[cfg.activation],
        dropout=cfg.dropout, attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        max_position_embeddings=cfg.max_len, scale_embedding=cfg.scale_embeddings,
        tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, bos_token_id=bos_token_id,
        eos_token_id=eos_token_id, decoder_start_token_id=bos_token_id if bos_token_id is not None else cfg.pad_id,
        forced_eos_token_id=None, use_cache=True,  # MarianForCausalLM makes it a decoder alone
    )


def _copy_pairs(cfg: ModelConfig):
    """(aiayn name, MarianForCausalLM name) of every weight (a tied head is the embedding)."""
    for i in range(cfg.n_encoder_layers):
        ours, theirs = f"decoder.layers.{i}.", f"model.decoder.layers.{i}."
        pairs = [(f"self_attn.{proj}", f"self_attn.{proj}") for proj in _ATTENTION]
        pairs += [("attn_sublayer.norm", "self_attn_layer_norm"), ("feed_forward.linear1", "fc1"),
                  ("feed_forward.linear2", "fc2"), ("ffn_sublayer.norm", "final_layer_norm")]
        for src, dst in pairs:
            for suffix in (".weight", ".bias"):
                yield ours + src + suffix, theirs + dst + suffix
    yield "embed.tokens.weight", "model.decoder.embed_tokens.weight"
    if not cfg.tie_embeddings:
        yield "head.proj.weight", "lm_head.weight"


@torch.no_grad()
def to_marian_lm(model: DecoderOnlyModel, *, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """A `transformers.MarianForCausalLM` (eval mode) computing `model`'s logits, with greedy generation settings."""
    from transformers import MarianForCausalLM

    cfg: ModelConfig = model.config
    config = marian_lm_config(cfg, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    if cfg.pe_layout != "split":
        model = to_split_layout(model)
    hf = MarianForCausalLM(config).eval()
    ours, theirs = model.state_dict(), hf.state_dict()
    for src, dst in _copy_pairs(cfg):
        theirs[dst].copy_(ours[src])
    if cfg.tie_embeddings and hf.lm_head.weight.data_ptr() != hf.model.decoder.embed_tokens.weight.data_ptr():
        hf.lm_head.weight.copy_(ours["embed.tokens.weight"])  # transformers did not tie them: copy
    gen = hf.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = bos_token_id, eos_token_id, cfg.pad_id
    gen.decoder_start_token_id, gen.forced_eos_token_id, gen.bad_words_ids = None, None, None
    gen.do_sample, gen.num_beams, gen.no_repeat_ngram_size = False, 1, 0
    return hf


def export_marian_lm(model: DecoderOnlyModel, tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Write a decoder-only model of the paper's shape as a Hugging Face `MarianForCausalLM` and its tokenizer.

    `MarianForCausalLM.from_pretrained(directory)` and `AutoTokenizer.from_pretrained(directory)` load it; the
    tokenizer starts each text with `<s>`, and `generate()` ends a text at `</s>` (greedy by default).
    """
    directory = Path(directory)
    hf = to_marian_lm(model, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    with atomic_files(directory) as staging:
        hf.save_pretrained(staging)
        save_hf_tokenizer(tokenizer, staging, template="decoder", max_len=model.config.max_len)
    return directory
