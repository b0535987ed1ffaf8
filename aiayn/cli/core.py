"""`aiayn params`, `aiayn trace` and `aiayn demo`."""

from __future__ import annotations

import argparse

import torch

from aiayn.config import PRESETS, ModelConfig, preset


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the core sub-commands."""
    p = subparsers.add_parser("params", help="parameter table of a configuration, by part")
    p.add_argument("--preset", default="base", help=f"{', '.join(PRESETS)} (default: base)")
    p.add_argument("--config", help="a config.json instead of a preset")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. n_heads=16")
    p.set_defaults(func=cmd_params)

    t = subparsers.add_parser("trace", help="run a model on a text and print every stage with its shape")
    t.add_argument("text", nargs="?", default="How are you", help='text to trace (default: "How are you")')
    t.add_argument("--run", help="a saved model directory (default: a tiny untrained model)")
    t.add_argument("--seed", type=int, default=0, help="seed of the tiny untrained model")
    t.set_defaults(func=cmd_trace)

    d = subparsers.add_parser("demo", help="the main job on its built-in default")
    d.add_argument("--run", help="run directory (default: a new runs/demo[-N])")
    d.add_argument("--config", help="a run config (default: examples/demo.toml)")
    d.set_defaults(func=cmd_demo)


def _config(args: argparse.Namespace) -> ModelConfig:
    cfg = ModelConfig.from_json(args.config) if args.config else preset(args.preset)
    return cfg.with_overrides(args.overrides)


def cmd_params(args: argparse.Namespace) -> int:
    """Print the parameter table."""
    from aiayn.inspect import format_table, parameter_table

    cfg = _config(args)
    print(f"{cfg.architecture}: d_model={cfg.d_model} h={cfg.n_heads} d_k={cfg.d_k} d_ff={cfg.d_ff} "
          f"N={cfg.n_encoder_layers}/{cfg.n_decoder_layers} vocab={cfg.vocab_size:,}")
    print(format_table(parameter_table(cfg)))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """Print the stage-by-stage trace."""
    from aiayn.inspect import demo_model, format_trace, trace

    if args.run:
        from aiayn.io import load_model, load_tokenizers

        model = load_model(args.run)
        tokenizer, target_tokenizer = load_tokenizers(args.run)
    else:
        model, tokenizer = demo_model(args.seed)
        target_tokenizer = tokenizer
        print("(a tiny untrained model: the numbers show shapes and normalisation, not meaning)")
    with torch.inference_mode():
        print(format_trace(trace(model, tokenizer, args.text, target_tokenizer=target_tokenizer)))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The built-in demonstration: train English -> German number words, then evaluate on held-out numbers."""
    from aiayn.cli.train import run_demo

    return run_demo(args.run, args.config)
