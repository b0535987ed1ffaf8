"""`aiayn translate`: translate lines with a saved encoder-decoder model (greedy, beam search or sampling)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from aiayn.cli.options import (
    add_device_argument,
    add_precision_argument,
    input_lines,
    integer,
    number,
    progress_bar,
    show_progress,
)
from aiayn.config import MAX_INT

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn translate`."""
    p = subparsers.add_parser(
        "translate", help="translate lines with a trained model (beam 4, alpha 0.6 by default, as the paper)",
        description="Translate TEXT arguments, the lines of --input FILE, or stdin; one output line per input line "
                    "(to stdout, or --output FILE). Sentences are sorted by length and batched by token count.",
    )
    p.add_argument("text", nargs="*", help="sentences to translate (default: read --input or stdin)")
    p.add_argument("--run", required=True, help="model directory (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--input", "-i", help="file of sentences, one per line ('-' for stdin)")
    p.add_argument("--output", "-o", help="write the translations here, one line per input line (default: stdout)")
    p.add_argument("--num-beams", type=integer(1), default=4, help="beam width; 1 is greedy (default 4)")
    # The old spelling (fairseq's too), kept so that scripts written before still run.
    p.add_argument("--beam", type=integer(1), dest="num_beams", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--alpha", type=number(), default=0.6, help="length penalty alpha (default 0.6)")
    p.add_argument("--max-new-tokens", type=integer(1), default=None,
                   help="most output tokens (default: --length-ratio x source length + --extra-len)")
    # The old spelling, kept so that scripts written before still run (the model's max_len is its positions).
    p.add_argument("--max-len", type=integer(1), default=None, help=argparse.SUPPRESS)
    p.add_argument("--length-ratio", type=number(above=0), default=1.0,
                   help="a in the output limit a x source length + b (default 1, the paper's)")
    p.add_argument("--extra-len", type=integer(0), default=50, help="b in that limit (default 50, the paper's)")
    p.add_argument("--min-len", type=integer(0), default=0, help="fewest output tokens before </s>")
    p.add_argument("--no-repeat-ngram-size", type=integer(0), default=0,
                   help="no n-gram of this size twice in an output, as Hugging Face generate() (default 0: off)")
    p.add_argument("--repetition-penalty", type=number(above=0), default=1.0,
                   help="divide the score of tokens already output by this, as Hugging Face generate() (1: off)")
    p.add_argument("--sample", action="store_true", help="sample instead of searching (uses --num-beams 1)")
    p.add_argument("--temperature", type=number(above=0), default=1.0)
    p.add_argument("--top-k", type=integer(0), default=0)
    p.add_argument("--top-p", type=number(maximum=1, above=0), default=1.0)
    p.add_argument("--seed", type=integer(0, MAX_INT), default=None, help="seed for --sample")
    p.add_argument("--max-tokens", type=integer(1), default=4096, help="padded source tokens per batch (default 4096)")
    p.add_argument("--max-sentences", type=integer(0), default=0,
                   help="most sentences in a batch of --max-tokens (default 0: no cap beside the token count)")
    # The old spelling (fairseq's too), kept so that scripts written before still run; `embed` and `predict` take
    # --batch-size for another thing, a fixed number of texts per forward pass.
    p.add_argument("--batch-size", type=integer(0), dest="max_sentences", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    p.add_argument("--truncate", action="store_true",
                   help="cut sources longer than the model's max_len instead of stopping with an error")
    p.add_argument("--scores", action="store_true", help="print each output's score before it, tab-separated")
    p.add_argument("--show-attention", metavar="FILE.png",
                   help="save the cross-attention map (source x output tokens) of the first sentence")
    p.add_argument("--attention-layer", default="all",
                   help="'all' (one panel per layer), 'mean' (mean over layers) or a layer number; heads averaged")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_argument(p)
    add_precision_argument(p, measured=True)
    p.set_defaults(func=cmd_translate)


def _generation_config(args: argparse.Namespace):
    """The `GenerationConfig` the decoding options ask for (an option out of range is a ValueError)."""
    from aiayn.inference.generation import GenerationConfig

    for option, value in (("--num-beams", args.num_beams), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise ValueError(f"{option} must be at least 1, got {value}")
    if args.max_sentences < 0:
        raise ValueError(f"--max-sentences must not be negative, got {args.max_sentences}")
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens, max_len=args.max_len, length_ratio=args.length_ratio,
        extra_len=args.extra_len, min_len=args.min_len,
        num_beams=1 if args.sample else args.num_beams, length_penalty=args.alpha, do_sample=args.sample,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        repetition_penalty=args.repetition_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
        return_attention=bool(args.show_attention), return_scores=args.scores,
    )


def _one_line(text: str) -> str:
    """An output on one line: a line break the model wrote would shift every later line of the file."""
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


def cmd_translate(args: argparse.Namespace) -> int:
    """Translate; print (or write) one line per input line."""
    from aiayn.inference.translator import Translator
    from aiayn.paths import check_output_file
    from aiayn.rundir import atomic_open

    config = _generation_config(args)
    inputs = [("--input", args.input), ("--run", args.run)]
    output = check_output_file(args.output, "--output", inputs=inputs) if args.output is not None else None
    if args.show_attention is not None:  # an empty name is refused, not taken for none
        if args.show_attention.strip() and Path(args.show_attention).is_dir():
            raise IsADirectoryError(f"--show-attention {args.show_attention} is a directory; give a .png file name")
        check_output_file(args.show_attention, "--show-attention", inputs=[*inputs, ("--output", args.output)],
                          suffixes=_plot_suffixes())
    translator = Translator.from_pretrained(args.run, device=args.device, precision=args.precision)
    if args.show_attention:
        _attention_panels(args.attention_layer, translator.model.config.n_decoder_layers)
    lines = input_lines(args, "sentences")
    start = time.perf_counter()
    with progress_bar(len(lines), quiet=args.quiet, unit="sent", desc="translating") as bar:
        results = translator.translations(lines, config, max_tokens=args.max_tokens, max_sentences=args.max_sentences,
                                          truncate=args.truncate, progress=bar)
    seconds = time.perf_counter() - start
    rows = [f"{r.score:.4f}\t{_one_line(r.text)}" if args.scores else _one_line(r.text) for r in results]
    if output is None:
        for row in rows:
            print(row, flush=True)
    else:
        with atomic_open(output, "w") as handle:  # a failure leaves an earlier file whole
            handle.writelines(row + "\n" for row in rows)
    if output is not None or show_progress(len(lines), quiet=args.quiet):
        print(f"translated {len(lines)} lines in {seconds:.1f} s ({len(lines) / max(seconds, 1e-9):.1f} sentences/s, "
              f"{translator.backend.precision})" + (f"; wrote {output}" if output is not None else ""), file=sys.stderr)
    shown = [i for i, r in enumerate(results) if r.attention is not None][:1] if args.show_attention else []
    for i in shown:  # the first sentence that was not empty
        first = results[i]
        source = translator.encode([lines[i]], truncate=True)[0]
        save_attention_plot(first.attention, translator.source_tokenizer.id_pieces(source),
                            translator.target_tokenizer.id_pieces(first.tokens), args.show_attention,
                            layer=args.attention_layer)
        print(f"attention map saved to {args.show_attention}", file=sys.stderr)
    return 0


def _plot_suffixes() -> tuple[str, ...]:
    """The file endings matplotlib can save a figure as (.png, .pdf, .svg, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return tuple(f".{name}" for name in sorted(FigureCanvasBase.get_supported_filetypes()))


def _attention_panels(layer: str, n_layers: int) -> list[tuple[str, int | None]]:
    """(title, layer index or None for the mean) of each panel `--attention-layer` asks for."""
    if layer == "all":
        return [(f"layer {i + 1}", i) for i in range(n_layers)]
    if layer == "mean":
        return [("mean over layers", None)]
    try:
        index = int(layer)
    except ValueError:
        raise ValueError(f"--attention-layer must be 'all', 'mean' or a layer number, got {layer!r}") from None
    if not 1 <= index <= n_layers:
        raise ValueError(f"--attention-layer {index} is outside 1..{n_layers} (the model has {n_layers} decoder "
                         f"layer{'s' if n_layers != 1 else ''})")
    return [(f"layer {index}", index - 1)]


def save_attention_plot(weights: torch.Tensor, source: list[str], target: list[str], path: str | Path, *,
                        layer: str = "all") -> Path:
    """Draw cross-attention (n_layers, n_heads, T, S), averaged over heads, as a heat map per layer (or one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aiayn.rundir import atomic_output

    per_layer = weights.float().mean(dim=1)  # (n_layers, T, S): heads averaged
    chosen = _attention_panels(layer, per_layer.shape[0])
    panels = [(title, per_layer.mean(dim=0) if index is None else per_layer[index]) for title, index in chosen]
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
