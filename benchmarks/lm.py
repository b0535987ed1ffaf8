"""How fast a language model learns: aiayn's decoder-only model beside nanoGPT's, on one text, in one run.

The text (`--text FILE`, plain text) is split by position, its first 90% to train on and the rest to validate, for
both. In one process, on the same threads:

- aiayn trains as `aiayn train objective=causal_lm train=TRAIN valid=VALID test=VALID time_budget=BUDGET` trains it
  (its `Trainer`: the recipe a user gets by default, fitted to the text, with its own tokenizer, lossless BPE unless
  `--aiayn-tokenizer char`), its model of nanoGPT's sizes (`--aiayn-sizes nanogpt`, the default: `model.d_model`,
  `model.n_heads`, `model.n_layers`, `model.d_ff` = 4 x n_embd and a context, `max_source_len`, of
  block_size tokens) unless `--aiayn-sizes fitted` leaves them to the recipe or a KEY=VALUE override sets one;
- then nanoGPT's own model (benchmarks/nanogpt/model.py, vendored unmodified) trains with its own training loop as
  its train.py runs it on a CPU for shakespeare_char (`NanoGPT`; the README's CPU command), on characters (its
  prepare.py: the sorted set of the characters of the whole text), for as many seconds of training as aiayn's budget
  gave aiayn's optimizer steps (its accounts: the steps and the making of their batches), instead of max_iters.

What differs between the two recipes (aiayn's as `aiayn train` prints it; nanoGPT's in `NanoGPT`), aiayn's first:

- tokens: lossless BPE with a vocabulary fitted to the text (or characters) / characters;
- examples: the text as documents (between blank lines, or a line each in a file without one), `<s>` document
  `</s>` one after another as one stream, cut into windows of the context, each token a label once, shuffled into
  batches of about `max_tokens` tokens / `batch_size` windows of block_size characters at random offsets;
- optimizer: under a short budget (the narrow model) AdamW (0.9, 0.98), eps 1e-9, weight decay 0.1 on matrices, else
  Adam without weight decay, peak 3e-3 after a linear warmup over 30% of the planned steps, then a linear decay to 0 /
  AdamW (0.9, 0.99), weight decay 0.1 on matrices, peak 1e-3 after 100 warmup
  steps, then a cosine decay to 1e-4 at the planned end;
- loss: label smoothing 0.1, no gradient clipping / plain cross-entropy, gradients clipped at norm 1.0;
- model: GPT-2's shape both (pre-LN, learned positions, tied head); aiayn with biases, tanh GELU and a dropout fitted
  to the passes over the data / no biases, erf GELU, no dropout;
- precision: bf16 where a training step at these widths measured faster on this CPU (as `aiayn train` chooses),
  else float32 / float32;
- the run: aiayn validates (about 10% of its budget), keeps the best model, may stop early (patience) and tests at the
  end, all inside its budget / nanoGPT does not evaluate while it trains and keeps the model at the end.

Each is then scored alike: the negative log-likelihood of the whole validation text, every token scored once in
windows of the model's context, summed and divided by the characters of the validation text (nats a character,
and bits). nanoGPT reads the characters as one stream, its first given the last character of the training text;
aiayn reads the validation file as it reads a text file for training (documents as one stream, the blank lines
between documents standing as `</s>` `<s>`, a run of them as one; the first token given `<s>`), with the model
`aiayn.load` gives for the run: its sum is the run's own test loss (test=VALID) times the tokens scored.

Also reported: optimizer steps, tokens a second of training (each in its own tokens; characters a second to compare),
and each model's greedy continuation of the same prompt (`--prompt`, default the first line of the validation text).

    aiayn bench lm --text input.txt [--budget 5m] [--threads 2] [--aiayn-tokenizer char] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from nanogpt.model import GPT, GPTConfig  # benchmarks/nanogpt/model.py, vendored
from record import figure, new_work_dir  # benchmarks/record.py

import aiayn
from aiayn.data.collate import IGNORE, pad
from aiayn.rundir import atomic_write_text
from aiayn.training.budget import PROBE_STEPS, format_duration, parse_duration
from aiayn.training.config import load_run_config
from aiayn.training.loop import Trainer

TRAIN_SHARE = 0.9  # nanoGPT's prepare.py: the first 90% of the text trains, the rest validates
EVAL_TOKENS = 8192  # tokens a batch when scoring the validation text (memory only: the sums do not depend on it)
# Keys the bench sets for aiayn itself, and what sets them: both models train to one clock, in this process
BUDGET, TEXT = "use --budget (both models train to it)", "it comes from --text"
OWNED_KEYS = {"time_budget": BUDGET, "max_steps": BUDGET, "epochs": BUDGET, "train": TEXT, "valid": TEXT, "test": TEXT,
              "threads": "use --threads (both models train on them)", "objective": "a language model (causal_lm)",
              "processes": "aiayn trains in the bench's process, as nanoGPT does"}


@dataclass(frozen=True)
class NanoGPT:
    """nanoGPT's settings for a CPU: train.py's defaults as config/train_shakespeare_char.py and the README's CPU
    command (`--device=cpu --compile=False --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
    --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`) set them; a clock replaces max_iters."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    batch_size: int = 12
    dropout: float = 0.0
    bias: bool = False  # train.py's default
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_iters: int = 100
    seed: int = 1337
    log_interval: int = 250


# -- nanoGPT's side -------------------------------------------------------------------------------------------

def char_vocabulary(text: str) -> dict[str, int]:
    """nanoGPT's prepare.py for shakespeare_char: each character of the text, sorted, numbered from 0."""
    return {ch: i for i, ch in enumerate(sorted(set(text)))}


def nanogpt_lr(it: int, s: NanoGPT, lr_decay_iters: int) -> float:
    """train.py's `get_lr`: linear warmup, then cosine decay to `min_lr` at `lr_decay_iters`, then `min_lr`."""
    if it < s.warmup_iters:
        return s.learning_rate * (it + 1) / (s.warmup_iters + 1)
    if it > lr_decay_iters:
        return s.min_lr
    decay_ratio = (it - s.warmup_iters) / (lr_decay_iters - s.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return s.min_lr + coeff * (s.learning_rate - s.min_lr)


@contextlib.contextmanager
def said_by(name: str):
    """What the body prints (nanoGPT's own notes), each line behind `  name: `."""
    with contextlib.redirect_stdout(io.StringIO()) as said:
        yield
    for line in said.getvalue().splitlines():
        print(f"  {name}: {line}", flush=True)


def train_nanogpt(train_ids: torch.Tensor, vocab_size: int, s: NanoGPT, seconds: float) -> tuple[GPT, dict]:
    """train.py's loop on a CPU (no autocast, no compile, no gradient accumulation, no evaluation) for `seconds` of
    training: after `PROBE_STEPS` timed steps (the first, warming up, not counted), max_iters = lr_decay_iters = the
    steps the seconds buy at their pace; the clock ends the run."""
    torch.manual_seed(s.seed)
    with said_by("nanoGPT"):
        model = GPT(GPTConfig(n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd, block_size=s.block_size,
                              bias=s.bias, vocab_size=vocab_size, dropout=s.dropout))
        optimizer = model.configure_optimizers(s.weight_decay, s.learning_rate, (s.beta1, s.beta2), "cpu")

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:  # train.py's: windows at random offsets
        ix = torch.randint(len(train_ids) - s.block_size, (s.batch_size,))
        x = torch.stack([train_ids[i:i + s.block_size] for i in ix])  # (batch_size, block_size)
        y = torch.stack([train_ids[i + 1:i + 1 + s.block_size] for i in ix])
        return x, y

    max_iters, iter_num, train_s, warm_s = 0, 0, 0.0, 0.0
    model.train()
    X, Y = get_batch()
    while train_s < seconds:
        t0 = time.perf_counter()
        lr = nanogpt_lr(iter_num, s, max(max_iters, s.warmup_iters + 1))
        for group in optimizer.param_groups:
            group["lr"] = lr
        logits, loss = model(X, Y)
        X, Y = get_batch()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        train_s += time.perf_counter() - t0
        if iter_num == 1:
            warm_s = train_s
        if iter_num == PROBE_STEPS + 1:
            pace = (train_s - warm_s) / PROBE_STEPS
            max_iters = iter_num + max(int((seconds - train_s) / pace), 0)
            print(f"  nanoGPT: {pace * 1000:.1f} ms a step: max_iters = lr_decay_iters = {max_iters}", flush=True)
        if iter_num % s.log_interval == 0:
            print(f"  nanoGPT: iter {iter_num}: loss {loss.item():.4f}, lr {lr:.2e}", flush=True)
    return model, {"steps": iter_num, "train_s": train_s, "tokens": iter_num * s.batch_size * s.block_size,
                   "chars_per_token": 1.0, "loss": loss.item()}


@torch.inference_mode()
def nanogpt_nll(model: GPT, ids: torch.Tensor, start: int) -> float:
    """The summed NLL of `ids[start:]`, each id given those before it in windows of block_size (the first window's
    first input is `ids[start - 1]`)."""
    model.eval()
    block = model.config.block_size
    inputs, targets = ids[start - 1:-1], ids[start:]
    whole = len(targets) // block
    x, y = inputs[:whole * block].view(whole, block), targets[:whole * block].view(whole, block)  # (windows, block)
    total, rows = 0.0, max(EVAL_TOKENS // block, 1)
    for i in range(0, whole, rows):
        _, loss = model(x[i:i + rows], y[i:i + rows])  # the mean over the batch's targets
        total += float(loss) * y[i:i + rows].numel()
    rest = len(targets) - whole * block
    if rest:
        _, loss = model(inputs[-rest:][None], targets[-rest:][None])  # (1, rest)
        total += float(loss) * rest
    return total


def nanogpt_continue(model: GPT, vocabulary: dict[str, int], prompt: str, chars: int) -> str:
    """nanoGPT's `generate` with top_k=1 (greedy): the characters that follow `prompt`."""
    unknown = sorted(set(prompt) - set(vocabulary))
    if unknown:
        raise ValueError(f"the prompt holds characters the text does not ({''.join(unknown)!r}): give --prompt text "
                         "made of the text's characters")
    itos = {i: ch for ch, i in vocabulary.items()}
    model.eval()
    idx = torch.tensor([[vocabulary[ch] for ch in prompt]])  # (1, P)
    out = model.generate(idx, chars, top_k=1)
    return "".join(itos[i] for i in out[0, len(prompt):].tolist())


# -- aiayn's side ---------------------------------------------------------------------------------------------

class CountingTrainer(Trainer):
    """aiayn's trainer, unchanged, counting the tokens its optimizer steps train on."""

    tokens = 0

    def train_step(self, *args, **kwargs):
        stats = super().train_step(*args, **kwargs)
        self.tokens += int(stats["tokens"])
        return stats


def aiayn_overrides(paths: dict[str, Path], args: argparse.Namespace) -> list[str]:
    """`aiayn train`'s KEY=VALUE settings for the run: the files, the budget, the tokenizer, nanoGPT's sizes unless
    `--aiayn-sizes fitted`, and the user's overrides (which win over the sizes; the bench's own keys are refused)."""
    given = {item.split("=", 1)[0] for item in args.overrides}
    owned = sorted(given & set(OWNED_KEYS))
    if owned:
        raise SystemExit(f"aiayn bench lm sets {owned[0]} itself: {OWNED_KEYS[owned[0]]}")
    items = ["objective=causal_lm", f"train={paths['train']}", f"valid={paths['valid']}", f"test={paths['valid']}",
             f"time_budget={args.budget}", "processes=1", f"threads={args.threads}"]
    if args.aiayn_tokenizer:
        items.append(f"tokenizer={args.aiayn_tokenizer}")
    if args.aiayn_sizes == "nanogpt":
        sizes = {"model.d_model": args.nanogpt_embd, "model.n_heads": args.nanogpt_heads,
                 "model.d_ff": 4 * args.nanogpt_embd, "model.n_layers": args.nanogpt_layers,
                 "max_source_len": args.nanogpt_block}
        if "model.n_encoder_layers" in given:  # the depth under the name the saved config holds
            given.add("model.n_layers")
        items += [f"{key}={value}" for key, value in sizes.items() if key not in given]
    return items + list(args.overrides)


def train_aiayn(overrides: list[str], run_dir: Path) -> tuple[CountingTrainer, dict]:
    """Train aiayn through its `Trainer` under its time budget; the trainer, and steps, training seconds and tokens."""
    run = load_run_config(None, overrides)
    trainer = CountingTrainer(run, run_dir, report=lambda line: print(f"  aiayn: {line}", flush=True))
    result = trainer.fit()
    budget = result.budget  # the budget's accounts: the optimizer steps ("train") and the making of their batches
    train_tokens = sum(trainer.data.train.lengths)
    return trainer, {"steps": result.step, "train_s": budget["train_s"] + budget["data_s"], "tokens": trainer.tokens,
                     "budget": budget, "stopped": trainer.stopping,
                     "chars_per_token": len(Path(trainer.cfg.train).read_text(encoding="utf-8")) / max(train_tokens, 1)}


@torch.inference_mode()
def aiayn_nll(generator, trainer: Trainer, valid: Path) -> tuple[float, int]:
    """The summed NLL of the validation file read as the run reads a text file (its task's windows of the run's
    context, each id but the first a label once), with the loaded model; and the ids scored."""
    task = trainer.cfg.objective_task.configured(trainer.cfg)
    raw, _ = task.read(trainer.cfg, str(valid))
    tokenizer, model = generator.tokenizer, generator.model.eval()
    rows, _ = task.encode(raw, tokenizer, tokenizer, [], "valid")
    per_batch = max(EVAL_TOKENS // max(len(rows[0]), 1), 1) if rows else 1
    total, scored = 0.0, 0
    for i in range(0, len(rows), per_batch):
        chunk = rows[i:i + per_batch]
        batch = {"ids": pad([row[:-1] for row in chunk], tokenizer.pad_id).to(generator.device),  # (B, L)
                 "labels": pad([row[1:] for row in chunk], IGNORE).to(generator.device)}
        logits, labels = task.forward(model, batch)  # (N, V), (N,): the real positions
        total += float(F.cross_entropy(logits.float(), labels, reduction="sum"))
        scored += labels.numel()
    return total, scored


# -- the run --------------------------------------------------------------------------------------------------

def split_text(text: str, paths: dict[str, Path]) -> None:
    """Write the text's first 90% to `paths["train"]` and the rest to `paths["valid"]`."""
    n = int(len(text) * TRAIN_SHARE)
    paths["train"].write_text(text[:n], encoding="utf-8")
    paths["valid"].write_text(text[n:], encoding="utf-8")


def default_prompt(valid: str) -> str:
    """The first whole line of the validation text that is not blank, at most 40 characters."""
    lines = valid.split("\n")[1:] or [valid]
    return next((line for line in lines if line.strip()), valid)[:40]


def run_aiayn(overrides: list[str], paths: dict[str, Path], work: Path, prompt: str, new_chars: int) -> dict:
    """aiayn trained with `overrides`, scored on the validation text and continuing the prompt."""
    print("aiayn:", flush=True)
    trainer, result = train_aiayn(overrides, work / "aiayn")
    generator = aiayn.load(work / "aiayn")
    nll, scored = aiayn_nll(generator, trainer, paths["valid"])
    completion = generator.generate(prompt, max_new_tokens=new_chars)[0]
    continuation = completion.text[:new_chars] + (" </s>" if completion.ended else "")
    valid_chars = len(paths["valid"].read_text(encoding="utf-8"))
    result.update(nll=nll, scored_tokens=scored, loss_per_char=nll / valid_chars, continuation=continuation,
                  sizes=aiayn_sizes(generator, trainer.cfg))
    return result


def aiayn_sizes(generator, cfg) -> str:
    """The tokenizer and sizes aiayn trained with, in one line."""
    model = generator.model.config
    return (f"{cfg.tokenizer} tokens ({generator.tokenizer.vocab_size} in its vocabulary), d_model {model.d_model}, "
            f"{model.n_encoder_layers} layers, {model.n_heads} heads, d_ff {model.d_ff}, context {cfg.max_source_len}, "
            f"batches of {cfg.max_tokens} tokens, {sum(p.numel() for p in generator.model.parameters()):,} parameters")


def run_nanogpt(args: argparse.Namespace, text: str, seconds: float, prompt: str) -> dict:
    """nanoGPT trained for `seconds`, scored on the validation text and continuing the prompt."""
    print(f"nanoGPT ({format_duration(seconds)} of training):", flush=True)
    s = NanoGPT(n_layer=args.nanogpt_layers, n_head=args.nanogpt_heads, n_embd=args.nanogpt_embd,
                block_size=args.nanogpt_block, batch_size=args.nanogpt_batch)
    vocabulary = char_vocabulary(text)
    ids = torch.tensor([vocabulary[ch] for ch in text], dtype=torch.long)
    n = int(len(text) * TRAIN_SHARE)
    model, result = train_nanogpt(ids[:n], len(vocabulary), s, seconds)
    nll = nanogpt_nll(model, ids, n)
    result.update(nll=nll, scored_tokens=len(text) - n, loss_per_char=nll / (len(text) - n),
                  continuation=nanogpt_continue(model, vocabulary, prompt, args.new_chars),
                  sizes=f"characters ({len(vocabulary)}), n_embd {s.n_embd}, {s.n_layer} layers, {s.n_head} heads, "
                        f"4 x n_embd MLP, context {s.block_size}, batch {s.batch_size}, "
                        f"{sum(p.numel() for p in model.parameters()):,} parameters")
    return result


def report(results: dict[str, dict], text_path: str, valid_chars: int, prompt: str, budget: str) -> None:
    """The table, each model's sizes and continuation, and the figures of the record."""
    threads = torch.get_num_threads()
    print(f"\n{text_path}: validation {valid_chars:,} characters (the last {1 - TRAIN_SHARE:.0%}); aiayn's time "
          f"budget {budget}; {threads} thread{'s' if threads != 1 else ''}")
    print(f"{'model':8} {'steps':>7} {'train s':>8} {'tokens/s':>9} {'chars/s':>9} {'valid loss/char':>16} "
          f"{'bits/char':>10}")
    for name, r in results.items():
        tokens_s = r["tokens"] / max(r["train_s"], 1e-9)
        bits = r["loss_per_char"] / math.log(2)
        print(f"{name:8} {r['steps']:>7} {r['train_s']:>8.1f} {tokens_s:>9.0f} {tokens_s * r['chars_per_token']:>9.0f} "
              f"{r['loss_per_char']:>16.4f} {bits:>10.4f}")
        figure(f"{name}, valid loss", r["loss_per_char"], "nats/char")
        figure(f"{name}, valid bits", bits, "bits/char")
        figure(f"{name}, steps", r["steps"], "steps")
        figure(f"{name}, training", tokens_s, "tokens/s")
        figure(f"{name}, training chars", tokens_s * r["chars_per_token"], "chars/s")
    print("(tokens/s: each in its own tokens; chars/s: those times the training text's characters a token)")
    for name, r in results.items():
        print(f"{name}: {r['sizes']}")
    r = results["aiayn"]
    print(f"aiayn scored {r['scored_tokens']:,} tokens of the validation text; its run ended by {r['stopped']}")
    print(f"greedy continuations of {prompt!r} (</s>: aiayn ended the document):")
    for name, r in results.items():
        print(f"  {name:8} {r['continuation']!r}")


def parser() -> argparse.ArgumentParser:
    """The bench's options."""
    p = argparse.ArgumentParser(prog="aiayn bench lm", description=__doc__.split("\n\n")[0])
    p.add_argument("--text", required=True, help="a plain text file (UTF-8): its first 90%% trains, the rest validates")
    p.add_argument("--budget", default="5m", help="aiayn's time_budget (90s, 5m); nanoGPT trains for the seconds of "
                                                  "training aiayn had (default: 5m)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for both (default: torch's)")
    p.add_argument("--aiayn-tokenizer", choices=("bpe", "char"), default=None,
                   help="aiayn's tokenizer (default: its recipe's, lossless BPE); char: characters, as nanoGPT")
    p.add_argument("--aiayn-sizes", choices=("nanogpt", "fitted"), default="nanogpt",
                   help="nanogpt: aiayn's model takes nanoGPT's widths, depth and context (the default); fitted: "
                        "those aiayn's recipe fits to the text")
    defaults = NanoGPT()
    for name, dest, value in (("layers", "n_layer", defaults.n_layer), ("heads", "n_head", defaults.n_head),
                              ("embd", "n_embd", defaults.n_embd), ("block", "block_size", defaults.block_size),
                              ("batch", "batch_size", defaults.batch_size)):
        p.add_argument(f"--nanogpt-{name}", type=int, default=value, help=f"nanoGPT's {dest} (default: {value})")
    p.add_argument("--prompt", default=None, help="the prompt both continue (default: the first line of the "
                                                  "validation text)")
    p.add_argument("--new-chars", type=int, default=80, help="characters of each continuation (default: 80)")
    p.add_argument("--work", default=None, help="a new directory for the split text, aiayn's run and results.json "
                                                "(default: runs/bench-lm-N)")
    p.add_argument("overrides", nargs="*", help="aiayn config overrides (KEY=VALUE, model.KEY=VALUE)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints the table and writes `results.json` into the work directory."""
    args = parser().parse_args(argv)
    parse_duration(args.budget)  # a bad duration is refused before anything trains
    text = Path(args.text).read_text(encoding="utf-8")
    if len(text) < 10 * (args.nanogpt_block + 1):
        raise SystemExit(f"{args.text} holds {len(text)} characters: too few for a validation tenth longer than "
                         f"nanoGPT's context ({args.nanogpt_block}); give a longer text")
    work = Path(args.work) if args.work else new_work_dir("bench-lm")
    if work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise SystemExit(f"--work {work} is not an empty directory: the bench writes its split text, run and results "
                         "there; give a new one")
    paths = {"train": work / "train.txt", "valid": work / "valid.txt"}
    overrides = aiayn_overrides(paths, args)  # the keys the bench sets are refused before anything is written
    valid = text[int(len(text) * TRAIN_SHARE):]
    prompt = args.prompt if args.prompt is not None else default_prompt(valid)
    if not prompt:
        raise SystemExit("--prompt is empty: give the text both models continue")
    work.mkdir(parents=True, exist_ok=True)
    split_text(text, paths)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    results = {"aiayn": run_aiayn(overrides, paths, work, prompt, args.new_chars)}
    torch.set_num_threads(threads)  # the same threads for nanoGPT, whatever aiayn's run set
    results["nanoGPT"] = run_nanogpt(args, text, results["aiayn"]["train_s"], prompt)
    atomic_write_text(work / "results.json", json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    report(results, args.text, len(valid), prompt, args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
