"""Hugging Face `MarianMTModel` <-> aiayn `EncoderDecoderModel`: the same Transformer under other names.

Marian (and Hugging Face's port of it) is the paper's model: post-LN layers, static sinusoidal
positions (stored as a sin half then a cos half: aiayn's `pe_layout="split"`), embeddings x sqrt(d_model)
(`scale_embedding=True`), LayerNorm eps 1e-5, attention scaled by d_k ** -0.5. The only parameters
aiayn lacks are Marian's `final_logits_bias` (zeros unless trained; `from_marian` refuses non-zero ones).
A pre-LN model (`norm_first=True`) goes to Pegasus instead (`aiayn.interop.pegasus`), whose layers carry
the same names: the split layout, the weight copy and the generation settings here serve both.

A model in the paper's interleaved layout (sin on even, cos on odd dimensions: what `aiayn train`
uses by default) maps too: `to_split_layout` permutes the d_model basis, which turns interleaved
positions into split ones exactly (section 3.5's table is the same numbers in another order), and
every weight that reads or writes the residual stream absorbs the same permutation.

Generation settings: a `MarianConfig` defaults to `eos_token_id=0`, `forced_eos_token_id=0` and
published checkpoints add `bad_words_ids=[[pad]]`; `to_marian` sets eos to aiayn's `</s>`, and turns
forced EOS, bad words and n-gram blocking off, so `generate()` searches exactly as `aiayn.inference.generation` does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from aiayn.config import ModelConfig
from aiayn.interop.hf_tokenizer import save_hf_tokenizer
from aiayn.nn.model import EncoderDecoderModel, build_model
from aiayn.rundir import atomic_files
from aiayn.tokenization import Tokenizer

# aiayn's activation -> the `activation_function` of a Marian or Pegasus config.
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")


def layout_permutation(d_model: int) -> torch.Tensor:
    """Indices `perm` with `split_table == interleaved_table[:, perm]`: the even dimensions (sines), then the odd."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


# How each weight meets the residual stream (d_model), by the end of its name: "in" reads it (columns of a
# Linear, columns of an embedding table), "out" writes it (rows and bias of a Linear), "norm" is elementwise.
# Q/K/V outputs and the feed-forward's inner width are not the residual stream: they keep their order.
_RESIDUAL_ROLES = (
    (r"(tokens|token_types|positions)\.weight", "in"),
    (r"(q_proj|k_proj|v_proj|linear1)\.weight", "in"),
    (r"(q_proj|k_proj|v_proj|linear1)\.bias", None),
    (r"(out_proj|linear2)\.(weight|bias)", "out"),
    (r"(norm|final_norm)\.(weight|bias)", "norm"),
    (r"head\.proj\.weight", "in"),
)


def _permuted(name: str, value: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    for pattern, role in _RESIDUAL_ROLES:
        if re.search(rf"(^|\.){pattern}$", name):
            if role == "in":
                return value[:, perm]
            return value if role is None else value[perm]
    raise ValueError(f"no rule for weight {name!r}: cannot move it to the split layout")


@torch.no_grad()
def to_split_layout(model: EncoderDecoderModel) -> EncoderDecoderModel:
    """The same function of the input ids with `pe_layout="split"`: a new model (eval mode), weights permuted.

    With x_split = x_interleaved[..., perm] everywhere in the residual stream, every Linear that
    reads it takes its columns in the order `perm`, every Linear that writes it its rows and bias,
    LayerNorm its gain and bias (its mean and variance do not depend on the order), and the
    embedding tables their columns; attention scores, heads and the feed-forward's inner layer are
    untouched. A model already split is returned as a copy.
    """
    cfg: ModelConfig = model.config
    weight = next(model.parameters())
    split = build_model(cfg.replace(pe_layout="split")).to(dtype=weight.dtype, device=weight.device).eval()
    perm = layout_permutation(cfg.d_model).to(weight.device)
    state = model.state_dict()
    if cfg.pe_layout != "split":
        state = {name: _permuted(name, value, perm) for name, value in state.items()}
    split.load_state_dict(state)
    return split


def layer_problems(cfg: ModelConfig, family: str) -> list[str]:
    """What the layers Marian and Pegasus share cannot express of `cfg`, each with its fix; empty when they can."""
    problems = [] if cfg.has_cross_attention else ["it has no decoder (n_decoder_layers=0)"]
    return problems + stack_problems(cfg, family)


def stack_problems(cfg: ModelConfig, family: str) -> list[str]:
    """What a stack of Marian's or Pegasus's layers cannot express of `cfg`'s positions, biases, embedding and
    LayerNorm (a translator's and a language model's alike), each with its fix."""
    problems = []
    if cfg.positional != "sinusoidal":
        problems.append(f"{family} uses sinusoidal positions (positional=sinusoidal)")
    if not cfg.bias:
        problems.append(f"{family}'s projections have biases (bias=true)")
    if cfg.embedding_norm or cfg.type_vocab_size:
        problems.append(f"{family} has no embedding LayerNorm or token types")
    if cfg.layer_norm_eps != 1e-5:
        problems.append(f"{family}'s LayerNorm eps is 1e-5, not {cfg.layer_norm_eps}")
    return problems


def check_mappable(cfg: ModelConfig) -> None:
    """ValueError naming every option of `cfg` that Marian cannot express."""
    problems = layer_problems(cfg, "Marian")
    if cfg.norm_first:
        problems.insert(0, "Marian is post-LN (set norm_first=false, or export a pre-LN model as Pegasus)")
    if problems:
        raise ValueError("model cannot be mapped to Marian: " + "; ".join(problems))


def marian_config(cfg: ModelConfig, *, decoder_start_token_id: int | None = None, eos_token_id: int = 2):
    """The `MarianConfig` of an aiayn config; the decoder starts from `<pad>` unless told otherwise."""
    from transformers import MarianConfig

    check_mappable(cfg)
    return MarianConfig(decoder_vocab_size=cfg.target_vocab_size, share_encoder_decoder_embeddings=cfg.share_embeddings,
                        **translator_fields(cfg, decoder_start_token_id=decoder_start_token_id,
                                            eos_token_id=eos_token_id))


def translator_fields(cfg: ModelConfig, *, decoder_start_token_id: int | None, eos_token_id: int) -> dict:
    """The config fields Marian and Pegasus share: sizes, dropouts, positions, embedding scale and tying, the
    special ids (the decoder starts from `<pad>` unless told otherwise; no forced EOS, no BOS)."""
    return dict(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers,
        decoder_layers=cfg.n_decoder_layers, encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
        activation_function=ACTIVATIONS[cfg.activation], dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        max_position_embeddings=cfg.max_len, scale_embedding=cfg.scale_embeddings,
        tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, eos_token_id=eos_token_id,
        decoder_start_token_id=cfg.pad_id if decoder_start_token_id is None else decoder_start_token_id,
        forced_eos_token_id=None, bos_token_id=None,
    )


def _name_pairs(cfg: ModelConfig) -> Iterator[tuple[str, str]]:
    """(aiayn name, Marian / Pegasus name) of every parameter except the embeddings and the output projection."""
    for i in range(cfg.n_encoder_layers):
        ours, theirs = f"encoder.layers.{i}.", f"model.encoder.layers.{i}."
        for proj in _ATTENTION:
            yield f"{ours}self_attn.{proj}", f"{theirs}self_attn.{proj}"
        yield f"{ours}attn_sublayer.norm", f"{theirs}self_attn_layer_norm"
        yield f"{ours}feed_forward.linear1", f"{theirs}fc1"
        yield f"{ours}feed_forward.linear2", f"{theirs}fc2"
        yield f"{ours}ffn_sublayer.norm", f"{theirs}final_layer_norm"
    for i in range(cfg.n_decoder_layers):
        ours, theirs = f"decoder.layers.{i}.", f"model.decoder.layers.{i}."
        for proj in _ATTENTION:
            yield f"{ours}self_attn.{proj}", f"{theirs}self_attn.{proj}"
            yield f"{ours}cross_attn.{proj}", f"{theirs}encoder_attn.{proj}"
        yield f"{ours}self_attn_sublayer.norm", f"{theirs}self_attn_layer_norm"
        yield f"{ours}cross_attn_sublayer.norm", f"{theirs}encoder_attn_layer_norm"
        yield f"{ours}feed_forward.linear1", f"{theirs}fc1"
        yield f"{ours}feed_forward.linear2", f"{theirs}fc2"
        yield f"{ours}ffn_sublayer.norm", f"{theirs}final_layer_norm"
    if cfg.norm_first:  # a pre-LN stack ends with a LayerNorm (Pegasus's layer_norm)
        yield "encoder.final_norm", "model.encoder.layer_norm"
        yield "decoder.final_norm", "model.decoder.layer_norm"


def _copy_pairs(cfg: ModelConfig) -> Iterator[tuple[str, str]]:
    for ours, theirs in _name_pairs(cfg):
        for suffix in (".weight", ".bias"):
            yield ours + suffix, theirs + suffix
    if cfg.share_embeddings:
        yield "src_embed.tokens.weight", "model.shared.weight"
    else:
        yield "src_embed.tokens.weight", "model.encoder.embed_tokens.weight"
        yield "tgt_embed.tokens.weight", "model.decoder.embed_tokens.weight"
    if not cfg.tie_embeddings:
        yield "head.proj.weight", "lm_head.weight"


@torch.no_grad()
def to_marian(model: EncoderDecoderModel, *, decoder_start_token_id: int | None = None, eos_token_id: int = 2):
    """A `transformers.MarianMTModel` (eval mode) with `model`'s weights and plain generation settings.

    Args:
        model: an aiayn encoder-decoder configured like Marian (post-LN, sinusoidal positions); the
            interleaved layout is moved to Marian's split one first (`to_split_layout`).
        decoder_start_token_id: the first decoder input; None means `<pad>`, as Marian does. Pass
            `<s>` for a model trained by `aiayn train`, whose targets start with `<s>`.
        eos_token_id: the end-of-sentence id (aiayn's `</s>` is 2).
    """
    from transformers import MarianMTModel

    config = marian_config(model.config, decoder_start_token_id=decoder_start_token_id, eos_token_id=eos_token_id)
    return hf_translator(model, MarianMTModel, config, eos_token_id=eos_token_id)


@torch.no_grad()
def hf_translator(model: EncoderDecoderModel, hf_class: type, config, *, eos_token_id: int):
    """`hf_class(config)` (Marian or Pegasus, eval mode) holding `model`'s weights, moved to the split sinusoid
    layout first where needed, with plain generation settings."""
    if model.config.pe_layout != "split":
        model = to_split_layout(model)
    hf = hf_class(config).eval()
    copy_weights(model, hf)
    plain_generation(hf, model.config, eos_token_id=eos_token_id)
    return hf


@torch.no_grad()
def copy_weights(model: EncoderDecoderModel, hf) -> None:
    """Copy a split-layout aiayn model's weights into a Marian or Pegasus model of the same sizes."""
    cfg: ModelConfig = model.config
    ours, theirs = model.state_dict(), hf.state_dict()
    for src_name, dst_name in _copy_pairs(cfg):
        theirs[dst_name].copy_(ours[src_name])
    for embed in (hf.model.encoder.embed_tokens, hf.model.decoder.embed_tokens):
        if cfg.share_embeddings and embed.weight.data_ptr() != hf.model.shared.weight.data_ptr():
            embed.weight.copy_(ours["src_embed.tokens.weight"])  # transformers did not tie them: copy
    if cfg.tie_embeddings and hf.lm_head.weight.data_ptr() != hf.model.decoder.embed_tokens.weight.data_ptr():
        hf.lm_head.weight.copy_(ours["tgt_embed.tokens.weight"])
    hf.final_logits_bias.zero_()


def plain_generation(hf, cfg: ModelConfig, *, eos_token_id: int) -> None:
    """Set `hf.generation_config` to search as `aiayn.inference.generation` does: greedy, no forced EOS,
    no bad words, no n-gram blocking, length penalty 1, at most `cfg.max_len` tokens."""
    gen = hf.generation_config
    gen.decoder_start_token_id = hf.config.decoder_start_token_id
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = eos_token_id, cfg.pad_id, None
    gen.forced_eos_token_id, gen.bad_words_ids, gen.no_repeat_ngram_size = None, None, 0
    gen.num_beams, gen.max_length, gen.length_penalty = 1, cfg.max_len, 1.0


def export_marian(model: EncoderDecoderModel, source_tokenizer: Tokenizer, target_tokenizer: Tokenizer,
                  directory: str | Path, *, num_beams: int = 4, length_penalty: float = 0.6) -> Path:
    """Write a trained translator as a Hugging Face Marian model and tokenizer into `directory`.

    `MarianMTModel.from_pretrained(directory)` and `AutoTokenizer.from_pretrained(directory)` load it;
    the decoder starts from `<s>` as in training, and `generate()` defaults to the search of
    `aiayn translate` (beam 4, length penalty 0.6, Hugging Face's stopping rule). One shared vocabulary is one
    tokenizer; separate ones put the target's in `directory/target` (decode outputs with it).
    """
    hf = to_marian(model, decoder_start_token_id=target_tokenizer.bos_id, eos_token_id=target_tokenizer.eos_id)
    return save_translator(hf, source_tokenizer, target_tokenizer, directory, max_len=model.config.max_len,
                           num_beams=num_beams, length_penalty=length_penalty)


def save_translator(hf, source_tokenizer: Tokenizer, target_tokenizer: Tokenizer, directory: str | Path, *,
                    max_len: int, num_beams: int, length_penalty: float) -> Path:
    """Write a Hugging Face translator and its tokenizers into `directory`, `generate()` set to aiayn's beam search."""
    directory = Path(directory)
    gen = hf.generation_config
    gen.num_beams, gen.length_penalty = num_beams, length_penalty
    gen.early_stopping = False  # as `GenerationConfig`'s default: the best running beam may still win
    with atomic_files(directory) as staging:
        hf.save_pretrained(staging)
        save_hf_tokenizer(source_tokenizer, staging, template="marian", max_len=max_len)
        if target_tokenizer is not source_tokenizer:
            save_hf_tokenizer(target_tokenizer, staging / "target", template="marian", max_len=max_len)
    return directory


@torch.no_grad()
def from_marian(hf_model) -> EncoderDecoderModel:
    """An aiayn `EncoderDecoderModel` (eval mode) with a `MarianMTModel`'s weights.

    Raises:
        ValueError: the Marian model uses something aiayn lacks (a non-zero `final_logits_bias`,
            unequal encoder and decoder sizes, an unknown activation).
    """
    c = hf_model.config
    if c.encoder_attention_heads != c.decoder_attention_heads or c.encoder_ffn_dim != c.decoder_ffn_dim:
        raise ValueError("aiayn needs equal encoder and decoder head counts and d_ff")
    activation = {v: k for k, v in ACTIVATIONS.items()}.get(c.activation_function)
    if activation is None:
        raise ValueError(f"activation {c.activation_function!r} has no aiayn equivalent "
                         f"(choose one of {', '.join(ACTIVATIONS.values())})")
    if bool(hf_model.final_logits_bias.ne(0).any()):
        raise ValueError("this Marian model has a non-zero final_logits_bias, which aiayn's output layer lacks")
    shared = bool(c.share_encoder_decoder_embeddings)
    tied = bool(getattr(c, "tie_word_embeddings", True))
    cfg = ModelConfig(
        vocab_size=c.vocab_size, tgt_vocab_size=None if shared else c.decoder_vocab_size, d_model=c.d_model,
        n_heads=c.encoder_attention_heads, d_ff=c.encoder_ffn_dim, n_encoder_layers=c.encoder_layers,
        n_decoder_layers=c.decoder_layers, dropout=c.dropout, attention_dropout=c.attention_dropout,
        activation_dropout=c.activation_dropout, activation=activation, norm_first=False, layer_norm_eps=1e-5,
        positional="sinusoidal", pe_layout="split", max_len=c.max_position_embeddings,
        scale_embeddings=bool(c.scale_embedding), tie_embeddings=tied, share_embeddings=shared, pad_id=c.pad_token_id,
    )
    model = build_model(cfg)
    ours, theirs = model.state_dict(), hf_model.state_dict()
    for dst_name, src_name in _copy_pairs(cfg):
        ours[dst_name].copy_(theirs[src_name])
    return model.eval()
