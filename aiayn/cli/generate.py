"""`aiayn translate`: translate lines with a saved encoder-decoder model (greedy, beam search or sampling)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from aiayn.cli.options import add_device_argument, add_precision_argument

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn translate`."""
    p = subparsers.add_parser(
        "translate", help="translate lines with a trained model (beam 4, alpha 0.6 by default, as the paper)",
        description="Translate TEXT arguments, the lines of --input FILE, or stdin; one output line per input line.",
    )
    p.add_argument("text", nargs="*", help="sentences to translate (default: read --input or stdin)")
    p.add_argument("--run", required=True, help="model directory (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--input", help="file of sentences, one per line")
    p.add_argument("--beam", type=int, default=4, help="beam size; 1 is greedy (default 4)")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty alpha (default 0.6)")
    p.add_argument("--max-len", type=int, default=None,
                   help="most output tokens (default: source length + 50)")
    p.add_argument("--min-len", type=int, default=0, help="fewest output tokens before </s>")
    p.add_argument("--sample", action="store_true", help="sample instead of searching (uses --beam 1)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seed for --sample")
    p.add_argument("--batch-size", type=int, default=32, help="sentences decoded together")
    p.add_argument("--truncate", action="store_true",
                   help="cut sources longer than the model's max_len instead of stopping with an error")
    p.add_argument("--scores", action="store_true", help="print each output's score before it, tab-separated")
    p.add_argument("--show-attention", metavar="FILE.png",
                   help="save the cross-attention map (source x output tokens) of the first sentence")
    p.add_argument("--attention-layer", default="all",
                   help="'all' (one panel per layer), 'mean' (mean over layers) or a layer number; heads averaged")
    add_device_argument(p)
    add_precision_argument(p)
    p.set_defaults(func=cmd_translate)


def _read_lines(args: argparse.Namespace) -> list[str]:
    if args.text and args.input:
        raise ValueError("give sentences either as arguments or with --input, not both")
    if args.text:
        return list(args.text)
    from aiayn.data.readers import read_lines

    return read_lines(args.input or "-")  # "-": stdin


def cmd_translate(args: argparse.Namespace) -> int:
    """Translate and print one line per input line."""
    from aiayn.backends import select
    from aiayn.inference.generation import GenerationConfig, generate
    from aiayn.io import load_model, load_tokenizers

    if args.beam < 1:
        raise ValueError(f"--beam must be at least 1, got {args.beam}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.show_attention and Path(args.show_attention).is_dir():
        raise IsADirectoryError(f"--show-attention {args.show_attention} is a directory; give a .png file name")
    model = load_model(args.run)
    if not getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{args.run} holds an encoder-only model; translate needs an encoder-decoder")
    src_tok, tgt_tok = load_tokenizers(args.run)
    backend = select(args.device, "inference", args.precision)
    runner = backend.prepare(model)  # once: the device's fast path (see aiayn.backends)
    config = GenerationConfig(
        max_len=args.max_len, min_len=args.min_len, beam_size=1 if args.sample else args.beam,
        length_penalty=args.alpha, do_sample=args.sample, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, return_attention=bool(args.show_attention),
    )
    lines = _read_lines(args)
    limit = model.config.max_len
    pad = model.config.pad_id
    first = None
    for start in range(0, len(lines), args.batch_size):
        chunk = lines[start : start + args.batch_size]
        # Sources end with </s>, as in Marian and fairseq; an empty line stays empty.
        ids = [src_tok.encode(line, add_eos=True) if line.strip() else [] for line in chunk]
        for i, row in enumerate(ids):
            if len(row) > limit:
                if not args.truncate:
                    raise ValueError(f"line {start + i + 1} has {len(row)} tokens, more than the model's "
                                     f"max_len ({limit}); shorten it or pass --truncate")
                logger.warning("line %d truncated from %d to %d tokens", start + i + 1, len(row), limit)
                ids[i] = row[: limit - 1] + [src_tok.eos_id]
        width = max((len(row) for row in ids), default=0)
        src = torch.full((len(ids), width), pad, dtype=torch.long)
        for i, row in enumerate(ids):
            src[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        out = generate(runner, src.to(backend.device), bos_id=tgt_tok.bos_id, eos_id=tgt_tok.eos_id, config=config)
        for tokens, score in zip(out.tokens, out.scores.tolist()):
            text = tgt_tok.decode(tokens)
            print(f"{score:.4f}\t{text}" if args.scores else text, flush=True)
        if start == 0 and out.attention is not None:
            first = (out.attention[0], src_tok.id_pieces(ids[0]), tgt_tok.id_pieces(out.tokens[0]))
    if args.show_attention and first is not None:
        save_attention_plot(*first, args.show_attention, layer=args.attention_layer)
        print(f"attention map saved to {args.show_attention}", file=sys.stderr)
    return 0


def save_attention_plot(weights: torch.Tensor, source: list[str], target: list[str], path: str | Path, *,
                        layer: str = "all") -> Path:
    """Draw cross-attention (n_layers, n_heads, T, S), averaged over heads, as a heat map per layer (or one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aiayn.rundir import atomic_output

    per_layer = weights.float().mean(dim=1)  # (n_layers, T, S): heads averaged
    n_layers = per_layer.shape[0]
    if layer == "all":
        panels = [(f"layer {i + 1}", per_layer[i]) for i in range(n_layers)]
    elif layer == "mean":
        panels = [("mean over layers", per_layer.mean(dim=0))]
    else:
        try:
            index = int(layer)
        except ValueError:
            raise ValueError(f"--attention-layer must be 'all', 'mean' or a layer number, got {layer!r}") from None
        if not 1 <= index <= n_layers:
            raise ValueError(f"--attention-layer {index} is outside 1..{n_layers}")
        panels = [(f"layer {index}", per_layer[index - 1])]
    if not target or not source:
        raise ValueError("nothing to draw: the first sentence or its translation is empty")
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4, 0.5 * len(source)) * len(panels) + 1,
                                                       max(3, 0.4 * len(target)) + 1), squeeze=False)
    for ax, (title, grid) in zip(axes[0], panels):
        image = ax.imshow(grid.numpy(), cmap="viridis", vmin=0.0, aspect="auto")
        fig.colorbar(image, ax=ax, fraction=0.05)
        ax.set_xticks(range(len(source)), source, rotation=90)
        ax.set_yticks(range(len(target)), target)
        ax.set_xlabel("source")
        ax.set_ylabel("output")
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    with atomic_output(path) as tmp:
        fig.savefig(tmp)
    plt.close(fig)
    return path
