"""`aiayn train` and `aiayn eval` (and the training behind `aiayn demo`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from aiayn.cli.options import add_device_argument, add_precision_argument, integer, progress_bar


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn train` and `aiayn eval`."""
    t = subparsers.add_parser("train", help="train a Transformer on files or a built-in data set",
                              description="Train with the paper's recipe, or, for translation or text files, the "
                                          "recipe fitted to the corpus and the time_budget (recipe=paper keeps the "
                                          "paper's). "
                                          "CONFIG is a .toml or .json file; KEY=VALUE overrides training keys, "
                                          "model.KEY=VALUE model keys; time_budget=20m ends the run within 20 "
                                          "minutes, the test evaluation included.")
    t.add_argument("items", nargs="*", metavar="[CONFIG] KEY=VALUE",
                   help="an optional config file, then overrides such as dataset=numbers epochs=5 model.d_model=128")
    t.add_argument("--run", "--run-dir", dest="run", required=True,
                   help="run directory (checkpoints, logs, plots, final model); spell it --run-dir under torchrun, "
                        "whose own --run-path would swallow --run")
    t.add_argument("--resume", action="store_true", help="continue the run in --run from its latest checkpoint")
    t.add_argument("--init-from", dest="init_from", help="pretrained encoder directory (aiayn or BERT checkpoint)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--force", action="store_true",
                   help="train into a directory that holds files aiayn did not write (refused otherwise)")
    add_device_argument(t)
    t.set_defaults(func=cmd_train)

    e = subparsers.add_parser("eval", help="evaluate a trained run on its test (or valid) split or a file")
    e.add_argument("--run", required=True, help="a run directory written by `aiayn train`")
    e.add_argument("--split", choices=("test", "valid"), default="test")
    e.add_argument("--data", help="evaluate on this file instead (same format as the training data)")
    e.add_argument("--checkpoint", help="a checkpoint directory (or name under RUN/checkpoints) instead of "
                                        "the final model")
    e.add_argument("--num-beams", type=integer(1), help="beam width for decoding (default: the run's)")
    # The old spelling (fairseq's too), kept so that scripts written before still run.
    e.add_argument("--beam", type=integer(1), dest="num_beams", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    e.add_argument("--examples", type=integer(0), default=5, help="example predictions to print")
    e.add_argument("--json", action="store_true", help="print the metrics as JSON")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_argument(e)
    add_precision_argument(e)
    e.set_defaults(func=cmd_eval)


def _split_items(items: list[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], items[1:]
    for item in items:
        if "=" not in item:
            raise ValueError(f"{item!r} is neither KEY=VALUE nor the first argument (the config file)")
    return None, items


def _format_metrics(result: dict) -> str:
    losses = ("loss", "perplexity", "loss_per_char", "bits_per_char")
    names = (*losses, "token_accuracy", "exact_match", "bleu", "chrf", "accuracy", "macro_f1", "entity_f1",
             "entity_precision", "entity_recall")
    text = "  ".join(f"{name} {result[name]:.4g}" if name in losses else f"{name} {result[name]:.2f}"
                     for name in names if name in result)
    tokens = result.get("bleu_tokenize", "13a")
    return text + (f"  (BLEU on {tokens} tokens)" if "bleu" in result and tokens != "13a" else "")


def _print_examples(result: dict) -> None:
    for source, predicted, reference in result.get("examples", []):
        mark = "ok" if predicted.strip() == reference.strip() else "XX"
        print(f"  [{mark}] {source}\n       -> {predicted}" + ("" if mark == "ok" else f"   (expected {reference})"))


def _train(run, run_dir: str, *, resume: bool, progress: bool, force: bool = False,
           device: str | None = None) -> int:
    from tqdm.auto import tqdm

    from aiayn.cli.errors import SYSTEM, describe
    from aiayn.training import Trainer
    from aiayn.training.checkpoint import latest_checkpoint
    from aiayn.training.distributed import launch_rank

    start = time.perf_counter()
    def report(line: str) -> None:
        try:
            tqdm.write(line)
        except OSError:  # stdout closed, full or its reader gone: the run goes on (its logs are in run_dir)
            pass

    trainer = Trainer(run, run_dir, resume=resume, progress=progress, report=report, force=force, device=device)
    try:
        result = trainer.fit()
    except OSError as err:  # a full disk, say: what was saved before is intact
        code, line = describe(err)
        last = code == SYSTEM and trainer.lock is not None and latest_checkpoint(trainer.ckpt_dir)
        hint = f"; {last} is intact: continue with aiayn train --run {run_dir} --resume" if last else ""
        print(f"aiayn train: error: {line}{hint}", file=sys.stderr)
        return code
    minutes = (time.perf_counter() - start) / 60
    if launch_rank():  # under torchrun, rank 0 speaks for every process
        return 0
    if result.interrupted:
        print(f"interrupted at step {result.step}; resume with: aiayn train --run {run_dir} --resume")
        return 130
    print(f"trained {result.step} steps in {minutes:.1f} min; run directory: {run_dir}")
    if result.test:
        print("test: " + _format_metrics(result.test))
        _print_examples(result.test)
    return 0


def _check_resume_overrides(saved, resumed, overrides: list[str]) -> None:
    """Refuse an override of a setting the run fixed when it started (its tokenizer, objective, starting encoder):
    a resumed run would ignore it. Giving the value the run already has is allowed."""
    from aiayn.training.config import FIXED_AT_START

    keys = {item.split("=", 1)[0].strip(): item.strip() for item in overrides}
    changed = [item for key, item in keys.items()
               if key in FIXED_AT_START and getattr(saved, key) != getattr(resumed, key)]
    if changed:
        raise ValueError(f"--resume keeps the run's tokenizer, objective and starting encoder; drop "
                         f"{' '.join(changed)} (or start a new --run)")


def cmd_train(args: argparse.Namespace) -> int:
    """Train (or resume) a run."""
    from aiayn.training.config import load_run_config
    from aiayn.training.setup import read_run_config

    config, overrides = _split_items(args.items)
    if args.init_from:
        overrides = [*overrides, f"init_from={args.init_from}"]
    if args.resume:
        if config:
            raise ValueError("--resume continues with the run's saved config; give only KEY=VALUE overrides")
        model_items = [item for item in overrides if item.strip().startswith("model.")]
        if model_items:
            raise ValueError(f"--resume keeps the run's model; drop {' '.join(model_items)} (or start a new --run)")
        run = read_run_config(args.run, overrides)
        _check_resume_overrides(read_run_config(args.run).train, run.train, overrides)
    else:
        run = load_run_config(config, overrides)
    if "WORLD_SIZE" not in os.environ:  # not already one of a run's processes (or under torchrun)
        from aiayn.cli.processes import train_processes
        from aiayn.rundir import check_run_dir
        from aiayn.training.layout import resolved

        check_run_dir(args.run, resume=args.resume, force=args.force)  # refused in one line, before any process
        run, layout = resolved(run, device=args.device, resume=args.resume,
                               relaunchable=config is None or Path(config).is_file())
        if run.train.processes > 1:
            if layout is not None:
                print(f"training as {layout.why}", file=sys.stderr)
            decided = [f"processes={run.train.processes}", f"threads={run.train.threads}"]  # ranks do not decide again
            return train_processes(_rank_argv(args, decided), run.train.processes, run.train.threads)
    return _train(run, args.run, resume=args.resume, progress=not args.no_progress, force=args.force,
                  device=args.device)


def _rank_argv(args: argparse.Namespace, decided: list[str]) -> list[str]:
    """The `aiayn train` arguments each process of a `processes=N` run is started with: this command's own, and
    the layout's `decided` overrides."""
    def on(*pairs: tuple[str, bool]) -> list[str]:
        return [flag for flag, given in pairs if given]

    return [*on(("--debug", args.debug), ("--verbose", args.verbose)), "train", *args.items, *decided,
            "--run", args.run,
            *on(("--resume", args.resume), ("--no-progress", args.no_progress), ("--force", args.force)),
            *(["--init-from", args.init_from] if args.init_from else []),
            *(["--device", args.device] if args.device else [])]


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a finished run."""
    from aiayn.backends import inference_shape, select
    from aiayn.data.prepare import encode_split, load_labels, prepare_data, read_examples
    from aiayn.io import load_model, load_tokenizers
    from aiayn.training.checkpoint import load_checkpoint
    from aiayn.training.evaluate import EvalOptions, evaluate
    from aiayn.training.setup import read_run_config

    train_cfg = read_run_config(args.run).train
    data = prepare_data(train_cfg, tokenizers=load_tokenizers(args.run), labels=load_labels(args.run))
    if args.data:
        raw, stats = read_examples(train_cfg, args.data)
        data.test = encode_split(train_cfg, raw, data.source_tokenizer, data.target_tokenizer, data.labels, "data",
                                 stats)
        if not args.json:
            print("data " + stats.summary())
    model = load_model(args.run)
    if args.checkpoint:
        path = Path(args.checkpoint)
        if not path.is_dir():
            path = Path(args.run) / "checkpoints" / args.checkpoint
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint {args.checkpoint} not found")
        load_checkpoint(path, model)
    split = data.valid if args.split == "valid" and not args.data else data.test
    options = EvalOptions.from_train_config(train_cfg, num_beams=args.num_beams or train_cfg.num_beams,
                                            examples=args.examples)
    backend = select(args.device, "inference", args.precision or options.precision,
                     inference_shape=inference_shape(model))
    with progress_bar(len(split.items), quiet=args.quiet, unit="example",
                      desc=f"evaluating {args.data or args.split}") as bar:
        result = evaluate(model, data, split, options, backend=backend, progress=bar)
    if "loss" in result and not math.isfinite(result["loss"]):
        print(f"aiayn eval: error: the loss on {args.data or args.split} is {result['loss']} (not finite): the "
              "model's numbers overflow; evaluate an earlier checkpoint with --checkpoint", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.data or args.split}: {len(split.items)} examples  " + _format_metrics(result))
    _print_examples(result)
    return 0


def run_demo(run_dir: str | None = None, config: str | None = None) -> int:
    """Train on the number translation data set of `examples/demo.toml`; print test exact match, BLEU and examples."""
    from aiayn.training.config import example_config, load_run_config

    if run_dir is None:
        run_dir, n = "runs/demo", 1
        while Path(run_dir).exists():
            n += 1
            run_dir = f"runs/demo-{n}"
    path = config or example_config("demo")
    run = load_run_config(path)
    train_cfg = run.train
    model = run.model_config(vocab_size=train_cfg.vocab_size)
    print(f"aiayn demo ({path}): English -> German number words (num2words), {train_cfg.dataset_train} training / "
          f"{train_cfg.dataset_test} held-out test numbers below {train_cfg.dataset_max_number}, "
          "disjoint splits")
    print(f"model: d_model={model.d_model}, {model.n_encoder_layers}+{model.n_decoder_layers} layers; "
          f"{train_cfg.epochs} epochs; run directory {run_dir}")
    return _train(run, run_dir, resume=False, progress=True)
