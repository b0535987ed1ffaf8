"""Autoregressive generation on the KV cache: translate sources, or continue prompts.

Stable API: `generate(model, src, bos_id=..., eos_id=..., config=GenerationConfig(...)) -> GenerationOutput` for
encoder-decoder models, `continue_prompts(model, prompts, eos_id=..., config=...)` for decoder-only ones. Both run
the searches of `aiayn.inference.searches` (greedy, sampling, beam) over the decoder's states of
`aiayn.inference.steps`: the source is encoded once (its keys and values once per sentence) or the prompt run once,
and each step feeds only the newest token over the cached keys and values, so a step costs work proportional to
the prefix. A translation's length limit is relative to its source (`length_ratio` x source length + `extra_len`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aiayn.config import ModelConfig
from aiayn.inference.searches import Finished, GenerationConfig, search
from aiayn.inference.steps import DecodingState, start_causal
from aiayn.inference.steps import start as start_decoding
from aiayn.nn.model import DecoderOnlyModel, EncoderDecoderModel
from aiayn.nn.sizes import check_memory, forward_bytes

__all__ = ["GenerationConfig", "GenerationOutput", "continue_prompts", "generate", "new_token_limit"]


@dataclass
class GenerationOutput:
    """Generated ids per sentence (no `<s>`, no `</s>`), their scores (B,) and, on request, attention.

    `scores` is the sum of the model's log-probabilities of the output tokens (`</s>` included when
    emitted) for greedy decoding and sampling; for beam search it is that sum / length ** length_penalty.
    `attention[i]` is a (n_layers, n_heads, len(tokens[i]), S_i) tensor of cross-attention weights:
    row t is where the decoder looked when it produced token t; columns are the real source tokens.
    """

    tokens: list[list[int]]
    scores: torch.Tensor
    attention: list[torch.Tensor] | None = None


@torch.no_grad()
def generate(model: EncoderDecoderModel, src: torch.Tensor, *, bos_id: int, eos_id: int,
             config: GenerationConfig | None = None, on_finished: Finished | None = None) -> GenerationOutput:
    """Translate source ids (B, S), right-padded with the model's `pad_id`, into target ids.

    The model runs as given: pass `aiayn.backends.select(device).prepare(model)` for the fast path
    of the machine (decoding is mostly matrix-vector products), or the model itself for the plain one.

    Args:
        model: an encoder-decoder model (decoded in eval mode; its mode is restored afterwards).
        src: (B, S) int64 source ids; rows may end in padding.
        bos_id: the token the decoder starts from (`<s>`; Marian starts from `<pad>`).
        eos_id: the token that ends a sentence.
        config: the decoding settings.
        on_finished: called once for each sentence (its row in `src`, its tokens, its score, as returned) as
            soon as its search has ended and it left the batch, the rest when the last ends: a server can
            answer a short sentence before the long ones of its batch are done.

    Returns:
        `GenerationOutput`; an empty source (no real tokens) gives an empty output with score 0.

    Raises:
        ValueError: a source longer than the model's `max_len`, ids outside the vocabulary, bad settings.
    """
    config = config or GenerationConfig()
    _check_request(model, src, bos_id, eos_id)
    cfg = model.config
    batch = src.shape[0]
    real = src != cfg.pad_id  # (B, S)
    lengths = real.sum(dim=1)  # (B,)
    rows = lengths.nonzero()[:, 0]
    tokens: list[list[int]] = [[] for _ in range(batch)]
    scores = torch.zeros(batch)
    attention: list[torch.Tensor] | None = None
    if config.return_attention:
        n_layers, n_heads = len(model.decoder.layers), cfg.n_heads
        attention = [torch.zeros(n_layers, n_heads, 0, int(n)) for n in lengths]
    reported: set[int] = set()

    def finished(j: int, out_tokens: list[int], score: float) -> None:  # j: a row of `sub`
        reported.add(int(rows[j]))
        on_finished(int(rows[j]), out_tokens, score)

    if rows.numel() == 0:
        _report_rest(on_finished, batch, reported, tokens, scores)
        return GenerationOutput(tokens, scores, attention)

    sub, limits = decoded_part(model, src, rows, config)

    def begin(steps: int, beams: int, record: bool) -> DecodingState:
        return start_decoding(model, sub, steps, beams=beams, record=record)

    start = torch.full((len(rows), 1), bos_id, dtype=torch.long, device=src.device)
    out_tokens, out_scores, out_attn = search(model, begin, start, limits, eos_id, config,
                                              finished if on_finished is not None else None)
    for j, i in enumerate(rows.tolist()):
        tokens[i] = out_tokens[j]
        scores[i] = out_scores[j]
        if attention is not None:
            attention[i] = out_attn[j][:, :, : len(out_tokens[j]), real[i, : sub.shape[1]]]
    _report_rest(on_finished, batch, reported, tokens, scores)
    return GenerationOutput(tokens, scores, attention)


def decoded_part(model: EncoderDecoderModel, src: torch.Tensor, rows: torch.Tensor,
                 config: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The sources a search decodes, of `src` (B, S) checked by `generate`: its non-empty `rows` (R,) without the
    columns that are padding in every one of them (R, S'), and each one's limit of new tokens (R,); ValueError for a
    search too large for this machine's memory."""
    cfg = model.config
    real = src[rows] != cfg.pad_id  # (R, S)
    sub = src[rows][:, : int(real.any(dim=0).nonzero().max()) + 1]
    limits = new_tokens(config, real.sum(dim=1).cpu(), cfg.max_len)
    _check_search_size(model, len(rows), sub.shape[1], int(limits.max()), config)
    return sub, limits


@torch.no_grad()
def continue_prompts(model: DecoderOnlyModel, prompts: torch.Tensor, *, eos_id: int,
                     config: GenerationConfig | None = None) -> GenerationOutput:
    """Continue prompts (B, P) of one length (no padding) with a decoder-only model: the new ids of each.

    `config.max_new_tokens` None means `extra_len` new tokens; never past the model's `max_len` positions. The
    prompt counts as history for `repetition_penalty` and `no_repeat_ngram_size`, as in Hugging Face `generate()`.
    """
    config = config or GenerationConfig()
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompt ids must be a (batch, length >= 1) tensor, got {getattr(prompts, 'shape', prompts)}")
    if config.return_attention:
        raise ValueError("return_attention records cross-attention, which a decoder-only model has none of")
    limits = prompt_limits(model, prompts, eos_id, config)

    def begin(steps: int, beams: int, record: bool) -> DecodingState:
        return start_causal(model, prompts, steps, beams=beams)

    tokens, scores, _ = search(model, begin, prompts, limits, eos_id, config)
    return GenerationOutput(tokens, scores, None)


def prompt_limits(model: DecoderOnlyModel, prompts: torch.Tensor, eos_id: int,
                  config: GenerationConfig) -> torch.Tensor:
    """Each prompt's limit of new tokens (B,), of prompts (B, P) checked against the model and this machine's memory
    (ValueError names what to change)."""
    cfg = model.config
    if not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary (size {cfg.vocab_size})")
    if prompts.shape[1] >= cfg.max_len:
        raise ValueError(f"a prompt of {prompts.shape[1]} tokens leaves no room in the model's max_len "
                         f"({cfg.max_len}) positions; shorten it to at most {cfg.max_len - 1} tokens")
    if (prompts < 0).any() or (prompts >= cfg.vocab_size).any():
        raise ValueError(f"prompt ids must be in the vocabulary (0 to {cfg.vocab_size - 1}), got "
                         f"{int(prompts.min())} to {int(prompts.max())}")
    limit = new_token_limit(config, cfg.max_len, prompts.shape[1])
    _check_search_size(model, prompts.shape[0], prompts.shape[1], limit, config)
    return torch.full((prompts.shape[0],), limit, dtype=torch.long)


def new_tokens(config: GenerationConfig, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Most new tokens `generate` gives each source of `lengths` (a tensor of lengths): `max_new_tokens`, else
    `length_ratio` x its length + `extra_len`, within 1 and the model's `max_len`."""
    if config.max_new_tokens is not None:
        limits = torch.full(lengths.shape, config.max_new_tokens, dtype=torch.long)
    else:
        limits = (lengths * config.length_ratio).long() + config.extra_len
    return limits.clamp(min=1, max=max_len)


def new_token_limit(config: GenerationConfig, max_len: int, prompt_length: int) -> int:
    """Most new tokens `continue_prompts` gives a prompt of `prompt_length` ids: `max_new_tokens` (None: `extra_len`,
    at least 1), never past the model's `max_len` positions."""
    return min(max(config.max_new_tokens or config.extra_len, 1), max_len - prompt_length)


def _report_rest(on_finished: Finished | None, batch: int, reported: set[int], tokens: list[list[int]],
                 scores: torch.Tensor) -> None:
    """`on_finished` for the sentences the search did not report as they left the batch."""
    if on_finished is not None:
        for i in range(batch):
            if i not in reported:
                on_finished(i, tokens[i], float(scores[i]))


def _check_search_size(model: EncoderDecoderModel | DecoderOnlyModel, batch: int, src_len: int, steps: int,
                       config: GenerationConfig) -> None:
    """Refuse a beam wider than the vocabulary, and a search whose cache would not fit in memory (CPU). For a
    decoder-only model `src_len` is the prompt's length."""
    cfg = model.config
    vocab = cfg.target_vocab_size
    if config.num_beams > vocab:
        raise ValueError(f"num_beams {config.num_beams} is more than the target vocabulary ({vocab} tokens), so the "
                         f"beams could not differ: choose a beam of at most {vocab} (the paper's is 4)")
    param = next(iter(model.parameters()), None)
    if param is not None and param.device.type == "cpu":
        what = f"decoding {batch} {'prompt' if cfg.causal else 'sentence'}{'s' if batch != 1 else ''} with beam " \
               f"{config.num_beams}"
        fix = (f"choose a smaller --num-beams, or fewer {'prompts' if cfg.causal else 'sentences'} a batch "
               "(--max-tokens, --max-sentences)")
        check_memory(search_bytes(cfg, batch, src_len, steps, config), what, fix)


def search_bytes(cfg: ModelConfig, batch: int, src_len: int, steps: int, config: GenerationConfig) -> int:
    """About the memory a search of `batch` sentences (prompts) of `src_len` ids and up to `steps` new tokens holds:
    each hypothesis's self-attention keys and values over the steps, cross-attention ones over the source (a
    decoder-only model: its own keys and values over the prompt) and a few rows of vocabulary scores (the flat step
    keeps the cross-attention ones once per sentence, so for it this errs high), and first the pass over the sources
    (the prompts, for each beam): activations and (S x S) attention scores."""
    layers = cfg.n_encoder_layers if cfg.causal else cfg.n_decoder_layers
    per = 4 * (2 * layers * (steps + src_len) * cfg.d_model + 4 * cfg.target_vocab_size)
    first = forward_bytes(cfg, batch * (config.num_beams if cfg.causal else 1), src_len)
    return batch * config.num_beams * per + first


def _check_request(model: EncoderDecoderModel, src: torch.Tensor, bos_id: int, eos_id: int) -> None:
    """Reject a source that is not (B, S) or longer than the model's positions, and ids outside the vocabulary."""
    if not isinstance(src, torch.Tensor) or src.dim() != 2:
        raise ValueError(f"source ids must be a (batch, length) tensor, got {getattr(src, 'shape', type(src))}")
    cfg = model.config
    vocab = cfg.target_vocab_size
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
        if not 0 <= value < vocab:
            raise ValueError(f"{name} {value} is outside the target vocabulary (size {vocab})")
    if src.shape[1] > cfg.max_len:
        raise ValueError(
            f"source of {src.shape[1]} tokens is longer than the model's max_len ({cfg.max_len}); "
            f"truncate it to {cfg.max_len} tokens"
        )
