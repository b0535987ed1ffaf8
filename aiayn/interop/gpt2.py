"""Hugging Face `GPT2LMHeadModel` <-> aiayn `DecoderOnlyModel`: the same decoder-only model under other names.

GPT-2 is aiayn's decoder-only model with `norm_first=True` (pre-LN, a final LayerNorm `ln_f`), learned positions,
token embeddings not scaled by sqrt(d_model), biases, and the vocabulary head tied to the token embedding;
attention is scaled by d_k ** -0.5 as in section 3.2.1. Its projections are `Conv1D`s, whose weights are
stored (in, out), the transpose of a Linear's, and Q, K and V are one product `c_attn` (Q's columns, then K's,
then V's).

Some aiayn options GPT-2 has no setting for still map exactly, by writing what they compute into GPT-2's
weights: sinusoidal positions become the position table (rows up to `max_len`, GPT-2's `n_positions`),
`positional="none"` a table of zeros, `bias=false` zero biases, and an untied head with scaled embeddings
keeps its own `lm_head` while `wte` holds the scaled table. What cannot (post-LN layers, a scaled embedding
that the head shares, an embedding LayerNorm, token types) is named by `gpt2_problems`.

Dropout: aiayn's `dropout` is GPT-2's `embd_pdrop` and `resid_pdrop`, `attention_dropout` its `attn_pdrop`;
GPT-2 has no dropout on the feed-forward hidden layer (`activation_dropout` is left out). None of them acts
in eval mode, where the two models compute the same logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from aiayn.config import ModelConfig
from aiayn.interop.hf_tokenizer import save_hf_tokenizer
from aiayn.nn.model import DecoderOnlyModel, build_model
from aiayn.rundir import atomic_files
from aiayn.tokenization import Tokenizer

# aiayn's `activation` -> GPT-2's `activation_function`; `gelu_new` is GPT-2's own tanh approximation.
_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_FROM_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                     "gelu": "gelu", "relu": "relu"}


def gpt2_problems(cfg: ModelConfig) -> list[str]:
    """What keeps an aiayn config from GPT-2's layout, each with the setting that fixes it (empty when it maps)."""
    problems = []
    if not cfg.causal:
        problems.append("GPT-2 is a decoder-only language model (causal=true, n_decoder_layers=0)")
    if not cfg.norm_first:
        problems.append("GPT-2 is pre-LN (set norm_first=true)")
    if cfg.scale_embeddings and cfg.tie_embeddings:
        problems.append("GPT-2 does not scale the embedding its head shares (set scale_embeddings=false, "
                        "or tie_embeddings=false)")
    if cfg.embedding_norm:
        problems.append("GPT-2 has no LayerNorm on the embeddings (set embedding_norm=false)")
    if cfg.type_vocab_size:
        problems.append("GPT-2 has no token-type embeddings (set type_vocab_size=0)")
    return problems


def check_mappable(cfg: ModelConfig) -> None:
    """ValueError naming every option of `cfg` that GPT-2 cannot express."""
    problems = gpt2_problems(cfg)
    if problems:
        raise ValueError("model cannot be mapped to GPT-2: " + "; ".join(problems))


def gpt2_config(cfg: ModelConfig, *, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """The `GPT2Config` of an aiayn decoder-only config (ValueError when it does not map)."""
    from transformers import GPT2Config

    check_mappable(cfg)
    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.n_encoder_layers,
        n_head=cfg.n_heads, n_inner=cfg.d_ff, activation_function=_ACTIVATIONS[cfg.activation],
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.attention_dropout,
        layer_norm_epsilon=cfg.layer_norm_eps, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False, tie_word_embeddings=cfg.tie_embeddings, use_cache=True,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=cfg.pad_id,
    )


def _linear_pairs(cfg: ModelConfig) -> Iterator[tuple[str, str]]:
    """(aiayn module, GPT-2 Conv1D) of every projection but Q/K/V, which GPT-2 keeps in one `c_attn`."""
    for i in range(cfg.n_encoder_layers):
        ours, theirs = f"decoder.layers.{i}.", f"transformer.h.{i}."
        yield f"{ours}self_attn.out_proj", f"{theirs}attn.c_proj"
        yield f"{ours}feed_forward.linear1", f"{theirs}mlp.c_fc"
        yield f"{ours}feed_forward.linear2", f"{theirs}mlp.c_proj"


def _norm_pairs(cfg: ModelConfig) -> Iterator[tuple[str, str]]:
    """(aiayn LayerNorm, GPT-2 LayerNorm): each layer's two (before attention, before the FFN) and the final one."""
    for i in range(cfg.n_encoder_layers):
        yield f"decoder.layers.{i}.attn_sublayer.norm", f"transformer.h.{i}.ln_1"
        yield f"decoder.layers.{i}.ffn_sublayer.norm", f"transformer.h.{i}.ln_2"
    yield "decoder.final_norm", "transformer.ln_f"


def gpt2_state_dict(model: DecoderOnlyModel) -> dict[str, torch.Tensor]:
    """`model`'s weights under GPT2LMHeadModel's names and layouts (Conv1D weights (in, out), Q/K/V stacked).

    Positions and scaling GPT-2 lacks are written into its tables (the module docstring says which).
    """
    cfg: ModelConfig = model.config
    check_mappable(cfg)
    ours = {name: value.detach() for name, value in model.state_dict().items()}
    d = cfg.d_model
    out: dict[str, torch.Tensor] = {}

    def bias(name: str, width: int) -> torch.Tensor:
        return ours.get(name, torch.zeros(width))  # bias=false: zero biases compute the same

    for i in range(cfg.n_encoder_layers):
        attn = f"decoder.layers.{i}.self_attn."
        weights = [ours[f"{attn}{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]  # each (d, d), (out, in)
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(weights, dim=0).T  # (d, 3d), (in, out)
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat(
            [bias(f"{attn}{p}.bias", d) for p in ("q_proj", "k_proj", "v_proj")])  # (3d,)
    for src, dst in _linear_pairs(cfg):
        weight = ours[f"{src}.weight"]  # (out, in)
        out[f"{dst}.weight"] = weight.T  # (in, out)
        out[f"{dst}.bias"] = bias(f"{src}.bias", weight.shape[0])
    for src, dst in _norm_pairs(cfg):
        out[f"{dst}.weight"], out[f"{dst}.bias"] = ours[f"{src}.weight"], ours[f"{src}.bias"]
    out["transformer.wte.weight"] = ours["embed.tokens.weight"] * model.embed.tokens.scale
    if cfg.positional == "learned":
        out["transformer.wpe.weight"] = ours["embed.positions.weight"]
    elif cfg.positional == "sinusoidal":
        out["transformer.wpe.weight"] = model.embed.positions(cfg.max_len).detach()  # (max_len, d_model)
    else:
        out["transformer.wpe.weight"] = torch.zeros(cfg.max_len, d)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ours["head.proj.weight"]
    return {name: value.float().contiguous().clone() for name, value in out.items()}


@torch.no_grad()
def to_gpt2(model: DecoderOnlyModel, *, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """A `transformers.GPT2LMHeadModel` (eval mode) computing `model`'s logits, with greedy generation settings.

    Args:
        model: an aiayn decoder-only model that maps (`gpt2_problems` is empty).
        bos_token_id, eos_token_id: the start and end-of-text ids `generate()` uses (None: none).
    """
    from transformers import GPT2LMHeadModel

    cfg: ModelConfig = model.config
    hf = GPT2LMHeadModel(gpt2_config(cfg, bos_token_id=bos_token_id, eos_token_id=eos_token_id)).eval()
    state = gpt2_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (cfg.tie_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"GPT-2 weights do not fit: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings and hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr():
        hf.lm_head.weight.copy_(hf.transformer.wte.weight)  # transformers did not tie them: copy
    gen = hf.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = bos_token_id, eos_token_id, cfg.pad_id
    gen.do_sample, gen.num_beams = False, 1
    return hf


def config_from_gpt2(c) -> ModelConfig:
    """The aiayn `ModelConfig` of a `GPT2Config`; ValueError names a GPT-2 setting aiayn's model lacks."""
    problems = []
    activation = _FROM_ACTIVATIONS.get(c.activation_function)
    if activation is None:
        problems.append(f"activation_function {c.activation_function!r} has no aiayn equivalent "
                        f"(one of {', '.join(_FROM_ACTIVATIONS)})")
    if not c.scale_attn_weights:
        problems.append("scale_attn_weights=False (aiayn scales attention by d_k ** -0.5)")
    if c.scale_attn_by_inverse_layer_idx:
        problems.append("scale_attn_by_inverse_layer_idx=True (aiayn scales every layer alike)")
    if getattr(c, "add_cross_attention", False):
        problems.append("add_cross_attention=True (aiayn's decoder-only model has no cross-attention)")
    if problems:
        raise ValueError("this GPT-2 model cannot be mapped to aiayn: " + "; ".join(problems))
    return ModelConfig(
        vocab_size=c.vocab_size, d_model=c.n_embd, n_heads=c.n_head, d_ff=c.n_inner or 4 * c.n_embd,
        n_encoder_layers=c.n_layer, n_decoder_layers=0, causal=True, dropout=c.resid_pdrop,
        attention_dropout=c.attn_pdrop, activation=activation, norm_first=True, layer_norm_eps=c.layer_norm_epsilon,
        positional="learned", max_len=c.n_positions, scale_embeddings=False,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)), bias=True,
        pad_id=c.pad_token_id if c.pad_token_id is not None else 0,
    )


@torch.no_grad()
def from_gpt2(hf_model) -> DecoderOnlyModel:
    """An aiayn `DecoderOnlyModel` (eval mode) with a `GPT2LMHeadModel`'s weights."""
    cfg = config_from_gpt2(hf_model.config)
    model = build_model(cfg)
    ours, theirs = model.state_dict(), hf_model.state_dict()
    d = cfg.d_model
    for i in range(cfg.n_encoder_layers):
        attn = f"decoder.layers.{i}.self_attn."
        weight = theirs[f"transformer.h.{i}.attn.c_attn.weight"].T  # (3d, d), (out, in)
        bias = theirs[f"transformer.h.{i}.attn.c_attn.bias"]  # (3d,)
        for k, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            ours[f"{attn}{proj}.weight"].copy_(weight[k * d:(k + 1) * d])
            ours[f"{attn}{proj}.bias"].copy_(bias[k * d:(k + 1) * d])
    for dst, src in _linear_pairs(cfg):
        ours[f"{dst}.weight"].copy_(theirs[f"{src}.weight"].T)
        ours[f"{dst}.bias"].copy_(theirs[f"{src}.bias"])
    for dst, src in _norm_pairs(cfg):
        ours[f"{dst}.weight"].copy_(theirs[f"{src}.weight"])
        ours[f"{dst}.bias"].copy_(theirs[f"{src}.bias"])
    ours["embed.tokens.weight"].copy_(theirs["transformer.wte.weight"])
    ours["embed.positions.weight"].copy_(theirs["transformer.wpe.weight"])
    if not cfg.tie_embeddings:
        ours["head.proj.weight"].copy_(theirs["lm_head.weight"])
    return model.eval()


# -- export ------------------------------------------------------------------------------------------

def export_gpt2(model: DecoderOnlyModel, tokenizer: Tokenizer | None, directory: str | Path) -> Path:
    """Write a decoder-only model as a Hugging Face GPT-2 model (and tokenizer) into `directory`.

    `GPT2LMHeadModel.from_pretrained(directory)` and `AutoTokenizer.from_pretrained(directory)` load it; the
    tokenizer starts each text with `<s>`, and `generate()` ends a text at `</s>` (greedy by default).
    """
    directory = Path(directory)
    bos, eos = (None, None) if tokenizer is None else (tokenizer.bos_id, tokenizer.eos_id)
    hf = to_gpt2(model, bos_token_id=bos, eos_token_id=eos)
    with atomic_files(directory) as staging:
        hf.save_pretrained(staging)
        if tokenizer is not None:
            save_hf_tokenizer(tokenizer, staging, template="decoder", max_len=model.config.max_len)
    return directory


def logits_tolerance(cfg: ModelConfig, logits: torch.Tensor) -> float:
    """The largest |difference| two fp32 computations of the same logits may show: the products are the same, but
    the two libraries add their terms in other orders (Conv1D's addmm, one Q/K/V product, other attention kernels).

    Each inner product of K terms carries a relative error of about sqrt(K) fp32 epsilons; each layer adds
    its error to the residual stream, and the logits carry it at their own magnitude; a factor 8 covers the
    constants of that estimate.
    """
    widest = max(cfg.d_model, cfg.d_ff, logits.shape[1])  # the longest sum: a row, the FFN, attention
    scale = max(1.0, float(logits.abs().max()))
    return 8 * torch.finfo(torch.float32).eps * widest**0.5 * (cfg.n_encoder_layers + 1) * scale
