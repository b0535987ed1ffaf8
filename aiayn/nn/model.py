"""Encoder, Decoder, and the encoder-decoder, encoder-only and decoder-only models; `build_model(cfg)` wires them.

Data flow (docs/core.md, "Architecture map"): ids (B, L) -> embedding x sqrt(d_model) + positions -> N encoder layers
-> memory (B, S, d_model); shifted target ids (B, T) -> embedding + positions -> N decoder
layers -> (B, T, d_model) -> vocabulary head -> logits (B, T, V).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.nn.attention import AttentionCache, KVCache, MultiHeadAttention
from aiayn.nn.embedding import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
)
from aiayn.nn.feedforward import PositionwiseFeedForward
from aiayn.nn.heads import (
    MaskedLMHead,
    SequenceClassificationHead,
    TokenClassificationHead,
    VocabularyHead,
)
from aiayn.nn.layers import DecoderLayer, EncoderLayer, SublayerConnection
from aiayn.nn.masks import check_mask, key_padding_from_attention_mask, padding_mask
from aiayn.nn.sizes import check_model_fits
from aiayn.tasks.names import MASKED_LM, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION


class Embeddings(nn.Module):
    """Token embedding (x sqrt(d_model)) + positional encoding (+ token types) -> [LayerNorm] -> dropout.

    Positions are added, not concatenated (section 3.5).
    """

    def __init__(self, *, tokens: TokenEmbedding, positions: nn.Module | None,
                 token_types: nn.Embedding | None = None, norm: nn.LayerNorm | None = None,
                 dropout: float = 0.0):
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.token_types = token_types
        self.norm = norm
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor, *, offset: int = 0,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) ids -> (B, L, d_model); `offset` is the position of the first id."""
        x = self.tokens(ids)  # (B, L, d_model), already x sqrt(d_model) when configured
        if self.positions is not None:
            x = x + self.positions(ids.shape[1], offset=offset).to(x.dtype)  # (L, d_model) broadcast over B
        if self.token_types is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(ids)
            elif token_type_ids.shape != ids.shape:
                raise ValueError(
                    f"token_type_ids of shape {tuple(token_type_ids.shape)} must match ids {tuple(ids.shape)}"
                )
            x = x + self.token_types(token_type_ids)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def random_ids(vocab: int, batch: int, length: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random token ids (batch, length) from the upper nine tenths of a vocabulary: clear of the special ids at
    its start (padding, start, end), for inputs that only need to look like text to the layers."""
    low = min(max(4, vocab // 10), vocab - 1)
    return torch.randint(low, vocab, (batch, length), generator=generator)


class Encoder(nn.Module):
    """N encoder layers, each with its own weights (+ a final LayerNorm for pre-LN stacks)."""

    def __init__(self, layers: list[EncoderLayer], *, final_norm: nn.LayerNorm | None = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, is_causal: bool = False,
                caches: list[AttentionCache] | None = None) -> torch.Tensor:
        """(B, S, d_model) -> (B, S, d_model); `is_causal` and one cache per layer for a decoder-only stack."""
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, is_causal=is_causal, cache=None if caches is None else caches[i])
        return x if self.final_norm is None else self.final_norm(x)

    def example_inputs(self, batch: int, length: int, generator: torch.Generator | None = None) -> tuple:
        """Random arguments for `forward`: hidden states (batch, length, d_model)."""
        d_model = self.layers[0].self_attn.d_model if len(self.layers) else 1
        return (torch.randn(batch, length, d_model, generator=generator),)

    def hidden_states(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The input (B, S, d_model) and each layer's output, the last one `forward`'s (after the final LayerNorm
        of a pre-LN stack): Hugging Face's `output_hidden_states`."""
        states = [x]
        for layer in self.layers:
            states.append(layer(states[-1], mask))
        if self.final_norm is not None:
            states[-1] = self.final_norm(states[-1])
        return states


class Decoder(nn.Module):
    """N decoder layers (+ a final LayerNorm for pre-LN stacks)."""

    def __init__(self, layers: list[DecoderLayer], *, final_norm: nn.LayerNorm | None = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm

    def forward(self, x: torch.Tensor, memory: torch.Tensor, *, tgt_mask: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """(B, T, d_model) target states attending to memory (B, S, d_model) -> (B, T, d_model).

        Each layer's cross-attention weights (B, h, T, S) come through `aiayn.nn.attention.attention_weights`
        over `[layer.cross_attn for layer in self.layers]`.
        """
        for i, layer in enumerate(self.layers):
            x = layer(
                x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                self_cache=None if cache is None else cache.self_attn[i],
                cross_cache=None if cache is None else cache.cross_attn[i],
            )
        return x if self.final_norm is None else self.final_norm(x)



def _source_mask(ids: torch.Tensor, pad_id: int, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, 1, 1, S) bool mask of real source tokens, or None when nothing is padded (fast path)."""
    if attention_mask is not None:
        mask = (key_padding_from_attention_mask(attention_mask, ids) if attention_mask.dim() == 2
                else check_mask(attention_mask, ids.shape[0], ids.shape[1], ids.shape[1]))
    else:
        mask = padding_mask(ids, pad_id)
    # Nothing padded: no mask, which lets attention take its fastest kernel. Asked only of a CPU tensor,
    # where the answer is read without stalling a device.
    return None if mask.device.type == "cpu" and bool(mask.all()) else mask


class EncoderDecoderModel(nn.Module):
    """The Transformer of the paper (Figure 1): `encode` the source once, `decode` the shifted target."""

    def __init__(self, cfg: ModelConfig, *, src_embed: Embeddings, tgt_embed: Embeddings,
                 encoder: Encoder, decoder: Decoder, head: VocabularyHead):
        super().__init__()
        self.config = cfg
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.encoder = encoder
        self.decoder = decoder
        self.head = head
        self.register_load_state_dict_pre_hook(lambda module, state, prefix, *args: upgrade_keys(state, prefix))

    def source_mask(self, src: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """(B, 1, 1, S) bool mask of real source tokens, or None when the batch has no padding."""
        return _source_mask(src, self.config.pad_id, attention_mask)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Source ids (B, S) -> memory (B, S, d_model). `src_mask` defaults to `source_mask(src)`."""
        x = self.src_embed(src)  # (B, S, d_model); checks the ids
        if src_mask is None:
            src_mask = self.source_mask(src)
        else:
            src_mask = check_mask(src_mask, src.shape[0], src.shape[1], src.shape[1])
        return self.encoder(x, src_mask)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, *, memory_mask: torch.Tensor | None = None,
               cache: KVCache | None = None, tgt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Shifted target ids (B, T) and memory (B, S, d_model) -> decoder states (B, T, d_model).

        The look-ahead mask is always applied. Target padding is not masked by default: with
        right padding (the only kind aiayn makes) it cannot reach real positions through the
        look-ahead mask, and the loss ignores padded positions. With a `cache`, `tgt` holds only
        the new positions and the cache supplies the earlier ones. Each decoder layer's
        cross-attention weights (B, h, T, S) come through `aiayn.nn.attention.attention_weights`.
        """
        if tgt.dim() != 2:
            raise ValueError(f"target ids must have shape (batch, length), got {tuple(tgt.shape)}")
        if memory.dim() != 3 or memory.shape[0] != tgt.shape[0] or memory.shape[2] != self.config.d_model:
            raise ValueError(
                f"memory of shape {tuple(memory.shape)} does not fit a target batch of {tgt.shape[0]} "
                f"with d_model {self.config.d_model}"
            )
        offset = 0 if cache is None else cache.length
        batch, length, source_length = tgt.shape[0], tgt.shape[1], memory.shape[1]
        if memory_mask is not None:
            memory_mask = check_mask(memory_mask, batch, length, source_length)
        if tgt_mask is not None:
            tgt_mask = check_mask(tgt_mask, batch, length, offset + length)
        x = self.tgt_embed(tgt, offset=offset)  # (B, T, d_model)
        return self.decoder(x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask, cache=cache)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, *, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher forcing: source ids (B, S), shifted target ids (B, T) -> logits (B, T, V)."""
        if src_mask is None:
            src_mask = self.source_mask(src)
        memory = self.encode(src, src_mask)
        return self.head(self.decode(tgt, memory, memory_mask=src_mask))

    def example_inputs(self, batch: int, length: int, generator: torch.Generator | None = None) -> tuple:
        """Random arguments for `forward`: source and target ids, (batch, length) each."""
        cfg = self.config
        return (random_ids(cfg.vocab_size, batch, length, generator),
                random_ids(cfg.target_vocab_size, batch, length, generator))

    def new_cache(self) -> KVCache:
        """An empty key/value cache for incremental decoding."""
        return KVCache.empty(len(self.decoder.layers))


# Older names of weights, by prefix: the vocabulary head was `generator` before it was `head`, and the
# masked-LM head's vocabulary Linear was `decoder` (BERT's name) before it was `proj`.
_OLD_PREFIXES = {"generator.": "head.", "head.decoder.": "head.proj."}


def upgrade_keys(state_dict: dict, prefix: str = "") -> dict:
    """Rename, in place, the keys of weights saved under older names (`_OLD_PREFIXES`). Returns `state_dict`."""
    for old, new in _OLD_PREFIXES.items():
        for key in [k for k in state_dict if k.startswith(prefix + old)]:
            state_dict[prefix + new + key[len(prefix + old):]] = state_dict.pop(key)
    return state_dict


class EncoderModel(nn.Module):
    """Encoder-only model (BERT-style): embeddings, N encoder layers, and an optional task head."""

    def __init__(self, cfg: ModelConfig, *, embed: Embeddings, encoder: Encoder, head: nn.Module | None):
        super().__init__()
        self.config = cfg
        self.embed = embed
        self.encoder = encoder
        self.head = head
        self.register_load_state_dict_pre_hook(lambda module, state, prefix, *args: upgrade_keys(state, prefix))

    def source_mask(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """(B, 1, 1, L) bool mask of real tokens, or None when nothing is padded."""
        return _source_mask(ids, self.config.pad_id, attention_mask)

    def encode(self, ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
               token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Ids (B, L) -> hidden states (B, L, d_model).

        `attention_mask` is (B, L), 1/True for real tokens; by default tokens equal to `pad_id` are masked.
        """
        mask = self.source_mask(ids, attention_mask)
        return self.encoder(self.embed(ids, token_type_ids=token_type_ids), mask)

    def hidden_states(self, ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                      token_type_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The embeddings and every layer's states, each (B, L, d_model), the last `encode`'s (Hugging Face's
        `output_hidden_states`); the arguments as `encode`'s."""
        mask = self.source_mask(ids, attention_mask)
        return self.encoder.hidden_states(self.embed(ids, token_type_ids=token_type_ids), mask)

    def example_inputs(self, batch: int, length: int, generator: torch.Generator | None = None) -> tuple:
        """Random arguments for `forward`: ids (batch, length)."""
        return (random_ids(self.config.vocab_size, batch, length, generator),)

    def forward(self, ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Ids (B, L) -> the head's logits, or hidden states (B, L, d_model) when there is no head."""
        hidden = self.encode(ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        if self.head is None:
            return hidden
        mask = self.source_mask(ids, attention_mask)
        return self.head(hidden, None if mask is None else mask[:, 0, 0, :])


class DecoderOnlyModel(nn.Module):
    """Decoder-only language model (GPT): the paper's decoder without cross-attention.

    Embeddings, N layers of masked self-attention -> Add & Norm -> feed-forward -> Add & Norm (`EncoderLayer`s run
    with the look-ahead mask), and the vocabulary head, tied to the token embedding by default (section 3.4).
    """

    def __init__(self, cfg: ModelConfig, *, embed: Embeddings, decoder: Encoder, head: VocabularyHead):
        super().__init__()
        self.config = cfg
        self.embed = embed
        self.decoder = decoder
        self.head = head

    def decode(self, ids: torch.Tensor, *, caches: list[AttentionCache] | None = None) -> torch.Tensor:
        """Ids (B, L) -> hidden states (B, L, d_model); each position sees itself and the positions before.

        With `caches` (one per layer, `new_caches`), the ids continue the positions already cached: a
        decoding step feeds only its newest token.
        """
        offset = 0 if caches is None or caches[0].key is None else caches[0].key.shape[2]
        return self.decoder(self.embed(ids, offset=offset), is_causal=True, caches=caches)

    def new_caches(self) -> list[AttentionCache]:
        """One empty key/value cache per layer, for `decode`."""
        return [AttentionCache() for _ in self.decoder.layers]

    def example_inputs(self, batch: int, length: int, generator: torch.Generator | None = None) -> tuple:
        """Random arguments for `forward`: ids (batch, length)."""
        return (random_ids(self.config.vocab_size, batch, length, generator),)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids (B, L) -> next-token logits (B, L, V). Padding goes at the end: no real token attends to it."""
        return self.head(self.decode(ids))


# -- builders ------------------------------------------------------------------------------------

def _attention(cfg: ModelConfig) -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.n_heads, dropout=cfg.attention_dropout, bias=cfg.bias)


def _feed_forward(cfg: ModelConfig) -> PositionwiseFeedForward:
    return PositionwiseFeedForward(cfg.d_model, cfg.d_ff, activation=cfg.activation,
                                   dropout=cfg.activation_dropout, bias=cfg.bias)


def _final_norm(cfg: ModelConfig) -> nn.LayerNorm | None:
    # Pre-LN stacks leave the last residual sum un-normalised, so they end with a LayerNorm.
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm_first else None


def _embeddings(cfg: ModelConfig, vocab_size: int, tokens: TokenEmbedding | None = None) -> Embeddings:
    if tokens is None:
        tokens = TokenEmbedding(vocab_size, cfg.d_model, scale=cfg.scale_embeddings, pad_id=cfg.pad_id)
    positions: nn.Module | None
    if cfg.positional == "sinusoidal":
        positions = SinusoidalPositionalEncoding(cfg.d_model, max_len=cfg.max_len, layout=cfg.pe_layout)
    elif cfg.positional == "learned":
        positions = LearnedPositionalEmbedding(cfg.d_model, max_len=cfg.max_len)
    else:
        positions = None
    token_types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
    norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.embedding_norm else None
    return Embeddings(tokens=tokens, positions=positions, token_types=token_types, norm=norm,
                      dropout=cfg.dropout)


def build_encoder(cfg: ModelConfig) -> Encoder:
    """N encoder layers with independent weights."""
    layers = [
        EncoderLayer(self_attn=_attention(cfg), feed_forward=_feed_forward(cfg), d_model=cfg.d_model,
                     dropout=cfg.dropout, norm_first=cfg.norm_first, eps=cfg.layer_norm_eps)
        for _ in range(cfg.n_encoder_layers)
    ]
    return Encoder(layers, final_norm=_final_norm(cfg))


def build_decoder(cfg: ModelConfig) -> Decoder:
    """N decoder layers with independent weights."""
    layers = [
        DecoderLayer(self_attn=_attention(cfg), cross_attn=_attention(cfg), feed_forward=_feed_forward(cfg),
                     d_model=cfg.d_model, dropout=cfg.dropout, norm_first=cfg.norm_first,
                     eps=cfg.layer_norm_eps)
        for _ in range(cfg.n_decoder_layers)
    ]
    return Decoder(layers, final_norm=_final_norm(cfg))


def _init_weights(model: nn.Module) -> None:
    # Xavier-uniform for every projection matrix (as the Annotated Transformer and fairseq do);
    # embeddings keep their N(0, d_model^-0.5) init, LayerNorms their (1, 0).
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def architecture_of(model: nn.Module) -> str:
    """The shape of `model` as its config names it ("encoder-decoder", "encoder-only", "decoder-only"), or "not an
    aiayn model" for a module without an aiayn config: what a guard that takes one shape says of another."""
    return getattr(getattr(model, "config", None), "architecture", "not an aiayn model")


def build_model(cfg: ModelConfig) -> EncoderDecoderModel | EncoderModel | DecoderOnlyModel:
    """Build the model a config describes: decoder-only when `causal`, encoder-decoder when `n_decoder_layers > 0`,
    else encoder-only.

    A config too large for this machine's memory (`d_model=1048576`, `max_len=10**11`, a million layers) raises
    MemoryError naming its sizes before anything is allocated (`aiayn.nn.sizes`).
    """
    if not isinstance(cfg, ModelConfig):
        hint = " (from a dict: build_model(ModelConfig.from_dict(d)))" if isinstance(cfg, dict) else ""
        raise TypeError(f"build_model takes a ModelConfig, got {type(cfg).__name__}{hint}")
    if torch.empty(0).device.type != "meta":
        check_model_fits(cfg)  # by arithmetic: microseconds, whatever the sizes
    return _build(cfg)


def set_dropout(model: nn.Module, p: float) -> nn.Module:
    """`model` (built, or a prepared copy of one) with its residual dropout, `ModelConfig.dropout`, set to `p`, in
    place: on every sub-layer's output, on embedding + positions and before a labelling head (section 5.4), and in its
    config; the attention and feed-forward hidden dropouts are other keys and stay. Returns `model`."""
    for module in model.modules():
        if isinstance(module, (SublayerConnection, Embeddings, SequenceClassificationHead, TokenClassificationHead)):
            module.dropout.p = p
    model.config = model.config.replace(dropout=p)
    return model


# The encoder-only heads by `ModelConfig.head` (the task objects in aiayn.tasks name the head they train).
_HEADS: dict[str, Callable[[ModelConfig], nn.Module]] = {
    SEQUENCE_CLASSIFICATION: lambda cfg: SequenceClassificationHead(cfg.d_model, cfg.num_labels, pooling=cfg.pooling,
                                                                    dropout=cfg.dropout),
    TOKEN_CLASSIFICATION: lambda cfg: TokenClassificationHead(cfg.d_model, cfg.num_labels, dropout=cfg.dropout),
    MASKED_LM: lambda cfg: MaskedLMHead(cfg.d_model, cfg.vocab_size, activation=cfg.activation,
                                        eps=cfg.layer_norm_eps),
}


def _build(cfg: ModelConfig) -> EncoderDecoderModel | EncoderModel | DecoderOnlyModel:
    if cfg.causal:
        embed = _embeddings(cfg, cfg.vocab_size)
        head = VocabularyHead(cfg.d_model, cfg.vocab_size)
        model = DecoderOnlyModel(cfg, embed=embed, decoder=build_encoder(cfg), head=head)
        _init_weights(model)
        if cfg.tie_embeddings:
            head.proj.weight = embed.tokens.weight  # section 3.4
        return model
    if cfg.has_cross_attention:
        src_embed = _embeddings(cfg, cfg.vocab_size)
        shared = src_embed.tokens if cfg.share_embeddings else None
        tgt_embed = _embeddings(cfg, cfg.target_vocab_size, tokens=shared)
        head = VocabularyHead(cfg.d_model, cfg.target_vocab_size)
        model = EncoderDecoderModel(cfg, src_embed=src_embed, tgt_embed=tgt_embed, encoder=build_encoder(cfg),
                                    decoder=build_decoder(cfg), head=head)
        _init_weights(model)
        if cfg.tie_embeddings:
            head.proj.weight = tgt_embed.tokens.weight  # section 3.4: one matrix, three uses
        return model

    head = _HEADS[cfg.head](cfg) if cfg.head in _HEADS else None  # "none": hidden states
    embed = _embeddings(cfg, cfg.vocab_size)
    model = EncoderModel(cfg, embed=embed, encoder=build_encoder(cfg), head=head)
    _init_weights(model)
    if isinstance(head, MaskedLMHead) and cfg.tie_embeddings:
        head.proj.weight = embed.tokens.weight
    return model
