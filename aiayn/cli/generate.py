"""`aiayn generate`: continue prompts with a trained decoder-only language model (greedy, sampling or beam)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from aiayn.cli.options import add_device_argument, add_precision_argument, input_lines, integer, number
from aiayn.config import MAX_INT


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn generate`."""
    p = subparsers.add_parser(
        "generate", help="continue text with a trained language model (objective=causal_lm)",
        description="Continue each PROMPT argument, each line of --input FILE, or each line of stdin; one output "
                    "line per prompt: the prompt followed by its continuation (--only-new: the continuation).",
    )
    p.add_argument("text", nargs="*", metavar="PROMPT", help="prompts to continue (default: read --input or stdin)")
    p.add_argument("--run", required=True, help="model directory of a language model (objective=causal_lm)")
    p.add_argument("--input", "-i", help="file of prompts, one per line ('-' for stdin)")
    p.add_argument("--max-new-tokens", type=integer(1), default=50, help="most new tokens a prompt (default 50)")
    p.add_argument("--sample", action="store_true", help="sample instead of taking the most likely token")
    p.add_argument("--temperature", type=number(above=0), default=1.0)
    p.add_argument("--top-k", type=integer(0), default=0)
    p.add_argument("--top-p", type=number(maximum=1, above=0), default=1.0)
    p.add_argument("--num-beams", type=integer(1), default=1, help="beam width (default 1: greedy or sampling)")
    # The old spelling (fairseq's too), kept so that scripts written before still run.
    p.add_argument("--beam", type=integer(1), dest="num_beams", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--repetition-penalty", type=number(above=0), default=1.0,
                   help="divide the score of tokens already in the text by this, as Hugging Face generate() (1: off)")
    p.add_argument("--no-repeat-ngram-size", type=integer(0), default=0,
                   help="no n-gram of this size twice in the text (default 0: off)")
    p.add_argument("--seed", type=integer(0, MAX_INT), default=None, help="seed for --sample")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="end a continuation before this text (repeat for more; the first that occurs cuts)")
    p.add_argument("--only-new", action="store_true", help="print the continuation without its prompt")
    p.add_argument("--max-tokens", type=integer(1), default=4096,
                   help="prompt tokens per batch; a batch holds prompts of one length (default 4096)")
    p.add_argument("--max-sentences", type=integer(0), default=0,
                   help="most prompts in a batch of --max-tokens (default 0: no cap beside the token count)")
    # translate's old spelling of --max-sentences, so that one batch option reads the same in both commands
    p.add_argument("--batch-size", type=integer(0), dest="max_sentences", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    add_device_argument(p)
    add_precision_argument(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """Continue each prompt; print one line per prompt."""
    from aiayn.inference.generator import DEFAULT_SEARCH, Generator

    if args.sample and args.num_beams > 1:
        raise ValueError("--sample draws one continuation a prompt: leave --num-beams at 1")
    generator = Generator.from_pretrained(args.run, device=args.device, precision=args.precision)
    prompts = input_lines(args, "prompts")
    texts_only = dataclasses.replace(DEFAULT_SEARCH, return_scores=False)  # the completions' texts: no scores
    completions = generator.generate(prompts, texts_only,
                                     max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                     num_beams=args.num_beams, repetition_penalty=args.repetition_penalty,
                                     no_repeat_ngram_size=args.no_repeat_ngram_size, seed=args.seed,
                                     stop=args.stop, max_tokens=args.max_tokens, max_sentences=args.max_sentences)
    for prompt, completion in zip(prompts, completions):
        text = completion.text if args.only_new else prompt + completion.text
        print(text.replace("\r", " ").replace("\n", " "), flush=True)
    sys.stdout.flush()
    return 0
