"""Seeing inside a model: the parameter table by part, and a stage-by-stage trace of one text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aiayn.config import ModelConfig, preset
from aiayn.nn.model import EncoderDecoderModel, build_model
from aiayn.tokenization import Tokenizer, train_tokenizer

# -- parameter table --------------------------------------------------------------------------


def count(module: nn.Module) -> int:
    """Parameters of `module`, each shared tensor counted once."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def parameter_table(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(part, parameters) rows for a config, built on the meta device (no memory is allocated)."""
    with torch.device("meta"):
        model = build_model(cfg)
    rows: list[tuple[str, int]] = []

    def layer_rows(kind: str, layers: nn.ModuleList) -> None:
        layer = layers[0]
        norms = sum(count(m) for m in layer.modules() if isinstance(m, nn.LayerNorm))
        if kind == "encoder":
            rows.append(("encoder layer: multi-head attention", count(layer.self_attn)))
        else:
            rows.append(("decoder layer: masked multi-head self-attention", count(layer.self_attn)))
            rows.append(("decoder layer: multi-head cross-attention", count(layer.cross_attn)))
        rows.append((f"{kind} layer: feed-forward network", count(layer.feed_forward)))
        n_norms = sum(isinstance(m, nn.LayerNorm) for m in layer.modules())
        rows.append((f"{kind} layer: {_words(n_norms)} layer norms", norms))
        rows.append((f"one {kind} layer", count(layer)))
        rows.append((f"{_words(len(layers))} {kind} layers", sum(count(m) for m in layers)))

    if isinstance(model, EncoderDecoderModel):
        layer_rows("encoder", model.encoder.layers)
        layer_rows("decoder", model.decoder.layers)
        shared = model.src_embed.tokens is model.tgt_embed.tokens
        rows.append((
            f"embeddings ({'shared, ' if shared else ''}{cfg.vocab_size:,} x {cfg.d_model})",
            count(model.src_embed) + (0 if shared else count(model.tgt_embed)),
        ))
        tied = model.generator.proj.weight is model.tgt_embed.tokens.weight
        rows.append(("output projection" + (" (tied to the embeddings)" if tied else ""),
                     0 if tied else count(model.generator)))
    else:
        layer_rows("encoder", model.encoder.layers)
        rows.append((f"embeddings ({cfg.vocab_size:,} x {cfg.d_model})", count(model.embed)))
        if model.head is not None:
            rows.append((f"head ({cfg.head})", count(model) - count(model.embed) - count(model.encoder)))
    stacks = [getattr(model, name) for name in ("encoder", "decoder") if hasattr(model, name)]
    final_norms = sum(count(stack.final_norm) for stack in stacks if stack.final_norm is not None)
    if final_norms:
        rows.append(("final layer norms (pre-LN)", final_norms))
    rows.append(("total", count(model)))
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


def _capture_attention(attn: nn.Module, store: dict, hooks: list) -> None:
    attn.explicit = True
    hooks.append(attn.q_proj.register_forward_hook(lambda m, i, o: store.__setitem__("q", o)))
    hooks.append(attn.k_proj.register_forward_hook(lambda m, i, o: store.__setitem__("k", o)))
    hooks.append(attn.v_proj.register_forward_hook(lambda m, i, o: store.__setitem__("v", o)))
    hooks.append(attn.out_proj.register_forward_pre_hook(lambda m, i: store.__setitem__("concat", i[0])))
    hooks.append(attn.register_forward_hook(lambda m, i, o: store.__setitem__("weights", o[1])))


def _hook_output(module: nn.Module, store: dict, key: str, hooks: list) -> None:
    hooks.append(module.register_forward_hook(lambda m, i, o: store.__setitem__(key, o)))


@torch.no_grad()
def trace(model: nn.Module, tokenizer: Tokenizer, text: str, *, top_k: int = 5,
          target_tokenizer: Tokenizer | None = None) -> list[Stage | str]:
    """Run `model` on `text` and return each stage of the data flow in order (shapes, first values).

    Works for encoder-decoder models (the decoder takes one step from `<s>` and shows the
    next-token distribution, in `target_tokenizer`'s vocabulary when the model has two) and
    encoder-only models (the head's output).
    """
    model.eval()
    cfg: ModelConfig = model.config
    tokens = tokenizer.pieces(text)
    ids = torch.tensor([tokenizer.encode(text)], dtype=torch.long)
    if ids.shape[1] == 0:
        raise ValueError("the text has no tokens to trace")
    is_seq2seq = isinstance(model, EncoderDecoderModel)
    embed = model.src_embed if is_seq2seq else model.embed
    out: list[Stage | str] = [
        f"tokens ({len(tokens)}): {tokens}",
        f"token ids ({ids.shape[1]},): {ids[0].tolist()}",
    ]
    hooks: list = []
    store: dict = {}
    try:
        _hook_output(embed.tokens, store, "embedding", hooks)
        _hook_output(embed, store, "input", hooks)
        layer_stores = []
        for layer in model.encoder.layers:
            s: dict = {}
            _capture_attention(layer.self_attn, s, hooks)
            _hook_output(layer.attn_sublayer, s, "norm1", hooks)
            _hook_output(layer.feed_forward.activation, s, "hidden", hooks)
            _hook_output(layer.ffn_sublayer, s, "norm2", hooks)
            layer_stores.append(s)
        if is_seq2seq:
            memory = model.encode(ids)
        else:
            result = model(ids)
        scale = "x sqrt(d_model)" if cfg.scale_embeddings else ""
        out.append(_stage(f"token embedding {scale}".strip(), store["embedding"][0]))
        out.append(_stage(f"+ positional encoding ({cfg.positional})", store["input"][0]))
        for i, s in enumerate(layer_stores, start=1):
            out.append(f"-- encoder layer {i} --")
            out += _attention_stages(f"enc{i}", s, cfg.n_heads)
            out.append(_stage(f"enc{i} after Add & Norm 1", s["norm1"][0]))
            out.append(_stage(f"enc{i} FFN hidden ({cfg.activation})", s["hidden"][0]))
            out.append(_stage(f"enc{i} after Add & Norm 2", s["norm2"][0]))
        if not is_seq2seq:
            out.append(_stage("encoder output" if model.head is None else f"head output ({cfg.head})", result[0]))
            return out
        out.append(_stage("encoder output (memory)", memory[0]))
        target = target_tokenizer or tokenizer
        start = torch.tensor([[target.bos_id]])
        dec_stores = []
        for layer in model.decoder.layers:
            s = {"self": {}, "cross": {}}
            _capture_attention(layer.self_attn, s["self"], hooks)
            _capture_attention(layer.cross_attn, s["cross"], hooks)
            _hook_output(layer.self_attn_sublayer, s, "norm1", hooks)
            _hook_output(layer.cross_attn_sublayer, s, "norm2", hooks)
            _hook_output(layer.feed_forward.activation, s, "hidden", hooks)
            _hook_output(layer.ffn_sublayer, s, "norm3", hooks)
            dec_stores.append(s)
        hidden = model.decode(start, memory)
        logits = model.generator(hidden)
        out.append(f"-- decoder, first step from <s> (id {target.bos_id}) --")
        for i, s in enumerate(dec_stores, start=1):
            out.append(f"-- decoder layer {i} --")
            out += _attention_stages(f"dec{i} masked self-attn", s["self"], cfg.n_heads)[4:5]
            out.append(_stage(f"dec{i} after Add & Norm 1", s["norm1"][0]))
            out.append(_stage(f"dec{i} cross-attn weights over source", s["cross"]["weights"][0]))
            out.append(_stage(f"dec{i} after Add & Norm 2", s["norm2"][0]))
            out.append(_stage(f"dec{i} FFN hidden ({cfg.activation})", s["hidden"][0]))
            out.append(_stage(f"dec{i} after Add & Norm 3", s["norm3"][0]))
        out.append(_stage("logits = Linear(decoder output)", logits[0]))
        probs = logits[0, -1].softmax(-1)
        top = probs.topk(min(top_k, probs.numel()))
        pairs = ", ".join(f"{target.id_to_token(int(i))!r} {float(p):.3f}" for p, i in zip(top.values, top.indices))
        out.append(_stage("softmax: next-token probabilities", probs[None], f"top: {pairs}"))
        return out
    finally:
        for h in hooks:
            h.remove()
        for m in model.modules():
            if hasattr(m, "explicit"):
                m.explicit = False


def format_trace(stages: list[Stage | str]) -> str:
    """The trace as printable lines."""
    return "\n".join(str(s) for s in stages)

