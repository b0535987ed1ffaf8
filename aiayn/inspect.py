"""Seeing inside a model: the parameter table by part, and a stage-by-stage trace of one text."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aiayn.config import ModelConfig, preset
from aiayn.nn.attention import attention_weights
from aiayn.nn.model import EncoderDecoderModel, build_model
from aiayn.nn.sizes import parameter_count
from aiayn.tokenization import Tokenizer, train_tokenizer

# -- parameter table --------------------------------------------------------------------------


def count(module: nn.Module) -> int:
    """Parameters of `module`, each shared tensor counted once."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def parameter_table(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(part, parameters) rows for a config: one layer of each stack built on the meta device (no memory is
    allocated), the stacks and the total by arithmetic (`aiayn.nn.sizes`), so a million layers take no longer."""
    with torch.device("meta"):
        model = build_model(cfg.replace(n_encoder_layers=1, n_decoder_layers=min(cfg.n_decoder_layers, 1)))
    layer_counts = {"encoder": cfg.n_encoder_layers, "decoder": cfg.n_decoder_layers,
                    "decoder-only": cfg.n_encoder_layers}
    rows: list[tuple[str, int]] = []

    def layer_rows(kind: str, layers: nn.ModuleList) -> None:
        layer, n = layers[0], layer_counts[kind]
        norms = sum(count(m) for m in layer.modules() if isinstance(m, nn.LayerNorm))
        if kind == "encoder":
            rows.append(("encoder layer: multi-head attention", count(layer.self_attn)))
        elif kind == "decoder-only":
            rows.append(("decoder-only layer: masked multi-head self-attention", count(layer.self_attn)))
        else:
            rows.append(("decoder layer: masked multi-head self-attention", count(layer.self_attn)))
            rows.append(("decoder layer: multi-head cross-attention", count(layer.cross_attn)))
        rows.append((f"{kind} layer: feed-forward network", count(layer.feed_forward)))
        n_norms = sum(isinstance(m, nn.LayerNorm) for m in layer.modules())
        rows.append((f"{kind} layer: {_words(n_norms)} layer norms", norms))
        rows.append((f"one {kind} layer", count(layer)))
        rows.append((f"{_words(n)} {kind} layers", n * count(layer)))

    if cfg.architecture == "encoder-decoder":
        layer_rows("encoder", model.encoder.layers)
        layer_rows("decoder", model.decoder.layers)
        shared = model.src_embed.tokens is model.tgt_embed.tokens
        rows.append((
            f"embeddings ({'shared, ' if shared else ''}{cfg.vocab_size:,} x {cfg.d_model})",
            count(model.src_embed) + (0 if shared else count(model.tgt_embed)),
        ))
        tied = model.head.proj.weight is model.tgt_embed.tokens.weight
        rows.append(("output projection" + (" (tied to the embeddings)" if tied else ""),
                     0 if tied else count(model.head)))
    elif cfg.architecture == "decoder-only":
        layer_rows("decoder-only", model.decoder.layers)
        rows.append((f"embeddings ({cfg.vocab_size:,} x {cfg.d_model})", count(model.embed)))
        tied = model.head.proj.weight is model.embed.tokens.weight
        rows.append(("output projection" + (" (tied to the embeddings)" if tied else ""),
                     0 if tied else count(model.head)))
    else:
        layer_rows("encoder", model.encoder.layers)
        rows.append((f"embeddings ({cfg.vocab_size:,} x {cfg.d_model})", count(model.embed)))
        if model.head is not None:
            rows.append((f"head ({cfg.head})", count(model) - count(model.embed) - count(model.encoder)))
    stacks = [getattr(model, name) for name in ("encoder", "decoder") if hasattr(model, name)]
    final_norms = sum(count(stack.final_norm) for stack in stacks if stack.final_norm is not None)
    if final_norms:
        rows.append(("final layer norms (pre-LN)", final_norms))
    rows.append(("total", parameter_count(cfg)))
    return rows


def _words(n: int) -> str:
    return {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 8: "eight", 12: "twelve"}.get(n, str(n))


def format_table(rows: list[tuple[str, int]]) -> str:
    """Rows as aligned text."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:>14,}" for name, value in rows)


# -- trace ------------------------------------------------------------------------------------


@dataclass
class Stage:
    """One step of the data flow: a name, the tensor's shape and its first values."""

    name: str
    shape: tuple[int, ...]
    values: list[float]
    note: str = ""

    def __str__(self) -> str:
        vals = ", ".join(f"{v:.3f}" for v in self.values)
        shape = "(" + ", ".join(map(str, self.shape)) + ")"
        return f"{self.name:<46} {shape:<16} [{vals}{', ...' if self.values else ''}]" + (
            f"  {self.note}" if self.note else "")


def _stage(name: str, t: torch.Tensor, note: str = "", n: int = 4) -> Stage:
    return Stage(name, tuple(t.shape), [float(v) for v in t.detach().flatten()[:n]], note)


def demo_model(seed: int = 0) -> tuple[nn.Module, Tokenizer]:
    """A tiny untrained encoder-decoder and a tokenizer trained on the shipped sample text."""
    text = (Path(__file__).parent / "assets" / "corpus.txt").read_text(encoding="utf-8").splitlines()
    tokenizer = train_tokenizer(text, vocab_size=600, kind="bpe")
    torch.manual_seed(seed)
    cfg = preset("tiny").replace(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    return build_model(cfg).eval(), tokenizer


def _attention_stages(prefix: str, captured: dict, n_heads: int) -> list[Stage]:
    def heads(t: torch.Tensor) -> torch.Tensor:  # (1, L, d_model) -> (h, L, d_k)
        return t[0].view(t.shape[1], n_heads, -1).transpose(0, 1)

    q, k, v = heads(captured["q"]), heads(captured["k"]), heads(captured["v"])
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (h, L_q, L_k)
    weights = captured["weights"][0]  # (h, L_q, L_k)
    return [
        _stage(f"{prefix} Q = x W_Q, split into heads", q),
        _stage(f"{prefix} K = x W_K", k),
        _stage(f"{prefix} V = x W_V", v),
        _stage(f"{prefix} scores Q K^T / sqrt(d_k)", scores),
        _stage(f"{prefix} softmax weights", weights, "rows sum to 1"),
        _stage(f"{prefix} heads concatenated", captured["concat"][0]),
    ]


@contextmanager
def _recording(outputs: dict[str, nn.Module], inputs: dict[str, nn.Module] | None = None) -> Iterator[dict]:
    """A dict that forward hooks fill with each module's output (or first input) under its name; removed on exit."""
    store: dict = {}
    handles = [m.register_forward_hook(lambda m, i, o, key=key: store.__setitem__(key, o))
               for key, m in outputs.items()]
    handles += [m.register_forward_pre_hook(lambda m, i, key=key: store.__setitem__(key, i[0]))
                for key, m in (inputs or {}).items()]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def _projections(attn: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """The Q, K, V projections (outputs) and the output projection's input (the concatenated heads)."""
    return {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj}, {"concat": attn.out_proj}


@torch.no_grad()
def trace(model: nn.Module, tokenizer: Tokenizer, text: str, *, top_k: int = 5,
          target_tokenizer: Tokenizer | None = None) -> list[Stage | str]:
    """Run `model` on `text` and return each stage of the data flow in order (shapes, first values).

    Works for encoder-decoder models (the decoder takes one step from `<s>` and shows the
    next-token distribution, in `target_tokenizer`'s vocabulary when the model has two) and
    encoder-only models (the head's output).
    """
    from aiayn.backends.cpu import PackedFeedForward
    from aiayn.backends.fused import FusedQKVAttention, TorchEncoderLayer

    if any(isinstance(m, (FusedQKVAttention, TorchEncoderLayer, PackedFeedForward)) for m in model.modules()):
        # (its stacked or fused products never call the projections and activations whose outputs a trace shows)
        raise ValueError("trace shows the model as written, and this is a backend's prepared copy: pass the model "
                         "itself (the one given to Backend.prepare)")
    if getattr(model.config, "causal", False):
        raise ValueError("trace shows encoder-decoder and encoder-only models, and this is a decoder-only language "
                         "model: continue text with it (aiayn generate) instead")
    model.eval()
    tokens = tokenizer.pieces(text)
    ids = torch.tensor([tokenizer.encode(text)], dtype=torch.long)
    if ids.shape[1] == 0:
        raise ValueError("the text has no tokens to trace")
    if ids.shape[1] > model.config.max_len:  # a trace keeps every stage: (L x L) scores per layer and head
        raise ValueError(f"the text has {ids.shape[1]:,} tokens, more than the model's max_len "
                         f"({model.config.max_len:,}): trace a shorter text")
    out: list[Stage | str] = [
        f"tokens ({len(tokens)}): {tokens}",
        f"token ids ({ids.shape[1]},): {ids[0].tolist()}",
    ]
    memory, stages = _trace_encoder(model, ids)
    out += stages
    if model.config.architecture != "encoder-decoder":
        head = model.config.head
        result = memory if model.head is None else model.head(memory, None)
        out.append(_stage("encoder output" if model.head is None else f"head output ({head})", result[0]))
        return out
    out.append(_stage("encoder output (memory)", memory[0]))
    return out + _trace_decoder_step(model, memory, target_tokenizer or tokenizer, top_k)


def _trace_encoder(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[Stage | str]]:
    """Embedding, positions and every encoder layer's stages; returns the encoder output (1, L, d_model)."""
    cfg: ModelConfig = model.config
    embed = model.src_embed if cfg.architecture == "encoder-decoder" else model.embed
    scale = "x sqrt(d_model)" if cfg.scale_embeddings else ""
    x = embed(ids)  # (1, L, d_model)
    stages: list[Stage | str] = [_stage(f"token embedding {scale}".strip(), embed.tokens(ids)[0]),
                                 _stage(f"+ positional encoding ({cfg.positional})", x[0])]
    mask = model.source_mask(ids)
    for i, layer in enumerate(model.encoder.layers, start=1):
        outputs, inputs = _projections(layer.self_attn)
        outputs.update(norm1=layer.attn_sublayer, hidden=layer.feed_forward.activation, norm2=layer.ffn_sublayer)
        with _recording(outputs, inputs) as s, attention_weights([layer.self_attn]) as weights:
            x = layer(x, mask)
        s["weights"] = weights[0]
        stages.append(f"-- encoder layer {i} --")
        stages += _attention_stages(f"enc{i}", s, cfg.n_heads)
        stages.append(_stage(f"enc{i} after Add & Norm 1", s["norm1"][0]))
        stages.append(_stage(f"enc{i} FFN hidden ({cfg.activation})", s["hidden"][0]))
        stages.append(_stage(f"enc{i} after Add & Norm 2", s["norm2"][0]))
    if model.encoder.final_norm is not None:
        x = model.encoder.final_norm(x)
    return x, stages


def _trace_decoder_step(model: EncoderDecoderModel, memory: torch.Tensor, target: Tokenizer,
                        top_k: int) -> list[Stage | str]:
    """The decoder's first step from `<s>`: every layer's stages, the logits and the top next tokens."""
    cfg: ModelConfig = model.config
    x = model.tgt_embed(torch.tensor([[target.bos_id]]))  # (1, 1, d_model)
    stages: list[Stage | str] = [f"-- decoder, first step from <s> (id {target.bos_id}) --"]
    for i, layer in enumerate(model.decoder.layers, start=1):
        outputs = dict(norm1=layer.self_attn_sublayer, norm2=layer.cross_attn_sublayer,
                       hidden=layer.feed_forward.activation, norm3=layer.ffn_sublayer)
        with _recording(outputs) as s, attention_weights([layer.self_attn, layer.cross_attn]) as weights:
            x = layer(x, memory)
        self_weights, cross_weights = weights
        stages.append(f"-- decoder layer {i} --")
        stages.append(_stage(f"dec{i} masked self-attn softmax weights", self_weights[0], "rows sum to 1"))
        stages.append(_stage(f"dec{i} after Add & Norm 1", s["norm1"][0]))
        stages.append(_stage(f"dec{i} cross-attn weights over source", cross_weights[0]))
        stages.append(_stage(f"dec{i} after Add & Norm 2", s["norm2"][0]))
        stages.append(_stage(f"dec{i} FFN hidden ({cfg.activation})", s["hidden"][0]))
        stages.append(_stage(f"dec{i} after Add & Norm 3", s["norm3"][0]))
    if model.decoder.final_norm is not None:
        x = model.decoder.final_norm(x)
    logits = model.head(x)  # (1, 1, V)
    stages.append(_stage("logits = Linear(decoder output)", logits[0]))
    probs = logits[0, -1].softmax(-1)
    top = probs.topk(min(top_k, probs.numel()))
    pairs = ", ".join(f"{target.id_to_token(int(i))!r} {float(p):.3f}" for p, i in zip(top.values, top.indices))
    stages.append(_stage("softmax: next-token probabilities", probs[None], f"top: {pairs}"))
    return stages


def format_trace(stages: list[Stage | str]) -> str:
    """The trace as printable lines."""
    return "\n".join(str(s) for s in stages)

