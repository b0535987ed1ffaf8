"""Real-data translation: aiayn beside a Hugging Face `MarianMTModel`, both trained from scratch on this machine.

The data is English -> French from the system's compiled gettext catalogs (`aiayn corpus`: msgid -> msgstr,
templates dropped, one translation per English source, seeded train / valid / test split). In one run:

- aiayn trains exactly as `aiayn train examples/gettext-en-fr.toml` does (its `Trainer`: lossless BPE, the
  recipe, validation BLEU every `eval_every` steps choosing the final model), then decodes the test split;
- the peer is `transformers.MarianMTModel` of the same sizes (d_model, heads, d_ff, layers, vocabulary size,
  tied embeddings, sinusoidal positions, post-LN, ReLU, dropout), with the tokenizer its users would choose
  (`tokenizers.SentencePieceBPETokenizer`, the SentencePiece-style BPE that Marian models ship), trained on
  token-count batches of the same budget built by the same bucketing, for the same steps, with the same Adam
  settings, learning-rate schedule and label smoothing, validated at the same steps (greedy BLEU; the best
  weights are kept, as aiayn keeps its best checkpoint), then decoded with the same beam and length penalty.

aiayn trains in the layout `aiayn train` takes with the same config (`--layout train`, the default): where
that is N processes of one thread (a time budget on a CPU where they were measured faster, or `processes=N`),
the benchmark starts N processes of itself as `aiayn train` starts its own, and rank 0 reports. A step then
holds N batches, so steps are not comparable across layouts: batches and tokens a second are. `--layout
threads` keeps aiayn in this process, on the threads the peer has. The peer trains in this process on
`--threads` threads, as its users run it.

Reported for each: sacreBLEU and chrF on the test split (the raw references), training time (the
optimizer steps only; validation, checkpoints and test decoding are timed apart) as wall-clock seconds and
as this process's CPU seconds (which other jobs on the machine disturb less), steps, batches, and real
(source and target) tokens a second, each counted in its own tokenizer's tokens.

Learning in time (`--budget 20m --curve 5m`): aiayn trains under `time_budget` (the whole run, its test
decoding included, in the budget); the peer then trains for the training seconds aiayn had. Both validate
(greedy BLEU) each time their training time passes a multiple of `--curve`, so the two curves are read at
the same seconds of training, whatever validation costs. The peer keeps the shared sizes but not aiayn's
fitted recipe (pre-LN at 3e-3 diverges post-LN): it gets its users' recipe, `PEER_RECIPE`.

    aiayn bench translate [--steps 1500 | --budget 20m --curve 5m] [--lang es | --corpus DIR] [--threads 2]
                          [--layout threads]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from record import figure, new_work_dir  # benchmarks/record.py

from aiayn.data.batching import token_batches
from aiayn.data.gettext import catalog_files, read_gettext
from aiayn.rundir import TRAIN_CONFIG, atomic_write_text
from aiayn.tasks.metrics import translation_scores
from aiayn.training.budget import PROBE_STEPS, format_duration, parse_duration
from aiayn.training.config import example_config, load_run_config
from aiayn.training.layout import resolved
from aiayn.training.loop import Trainer, get_lr
from aiayn.training.recipe import fit_run
from aiayn.training.schedule import resolve_recipe


def prepare_corpus(directory: Path, lang: str) -> bool:
    """Write the gettext corpus into `directory` unless it is there; False when this machine has no catalogs."""
    if all((directory / f"{name}.tsv").is_file() for name in ("train", "valid", "test")):
        return True
    if not catalog_files(lang):
        return False
    read_gettext(lang).write(directory)
    return True


LANGUAGES = {"fr": "French", "es": "Spanish", "it": "Italian", "de": "German", "pt": "Portuguese", "nl": "Dutch"}
# What a Hugging Face / fairseq user trains a post-LN Transformer on small data with (fairseq's IWSLT recipe:
# Adam (0.9, 0.98), inverse square root, label smoothing 0.1), its 4,000-step warmup fitted to a short run
# as aiayn fits its own, and the peak rate of post-LN models that still trains (1e-3).
PEER_RECIPE = ["recipe=paper", "lr=1e-3", "warmup=0", "warmup_fraction=0.3"]
RANKS_RESULT = "aiayn-processes.json"  # what rank 0 of aiayn's training processes leaves for the launcher


def pair_name(corpus: Path, lang: str | None) -> str:
    """The pair a corpus holds: English -> `corpus.json`'s language (written by `aiayn corpus`), else `--lang`'s, else
    the corpus folder's name (a corpus of the user's own says nothing of its languages)."""
    meta = corpus / "corpus.json"
    if meta.is_file():
        lang = json.loads(meta.read_text(encoding="utf-8")).get("lang", lang)
    return f"English -> {LANGUAGES.get(lang, lang)}" if lang else f"the pairs of {corpus}"


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """The (source, target) rows of a TSV file the corpus step wrote."""
    return [tuple(line.split("\t")) for line in path.read_text(encoding="utf-8").splitlines() if line]


class TimedTrainer(Trainer):
    """aiayn's trainer, unchanged, with the time spent validating, checkpointing and testing recorded apart."""

    def __init__(self, *args, curve_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.side_seconds = {"setup": 0.0, "validate": 0.0, "save": 0.0, "test": 0.0}
        self.side_cpu, self.cpu_began = 0.0, time.process_time()
        self.curve_s = curve_s  # validate each time the training seconds pass a multiple of this (0: the run's)
        self.marks: list[tuple[float, int]] = []  # (training seconds, step) of each validation the curve asked for
        self.tokens = 0  # real source and target tokens trained on, over all processes
        self.timing = False  # inside a timed part: a part within it (a validation's save of the best) is its time

    def training_seconds(self) -> float:
        """Wall seconds of the run so far less setup, validation, checkpoints and testing."""
        return time.perf_counter() - self.started - sum(self.side_seconds.values())

    def after_setup(self):
        self.side_seconds["setup"] += time.perf_counter() - self.started  # setup restarts the clock
        self.side_cpu += time.process_time() - self.cpu_began

    def validation_due(self):
        if not self.curve_s:
            return super().validation_due()
        self.due_at = self.training_seconds()  # rank 0's clock decides for every process
        return self.parallel.from_rank0(self.due_at >= self.curve_s * (len(self.marks) + 1))

    def train_step(self, *args, **kwargs):
        stats = super().train_step(*args, **kwargs)
        self.tokens += int(stats["tokens"])
        return stats

    def after_step(self):
        if self.last_validated_step != self.step:
            return
        if self.budget is not None:  # the budget's beam-ratio sample after a validation is validation time too
            self.side_seconds["validate"] += self.budget.beam_probe_s
        if self.curve_s:  # under a budget, a validation the end has no room for is skipped
            self.marks.append((self.due_at, self.step))

    def _timed(self, name, fn, *args, **kwargs):
        if self.timing:  # (counted once, by the part it runs in)
            return fn(*args, **kwargs)
        start, cpu = time.perf_counter(), time.process_time()
        self.timing = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.timing = False
            self.side_seconds[name] += time.perf_counter() - start
            self.side_cpu += time.process_time() - cpu

    def validate(self):
        return self._timed("validate", super().validate)

    def save(self, **kwargs):
        return self._timed("save", super().save, **kwargs)

    def evaluate_test(self, num_beams=None):
        return self._timed("test", super().evaluate_test, num_beams)


def train_aiayn(run, run_dir: Path, curve_s: float = 0.0) -> dict | None:
    """Train and test aiayn through its `Trainer`; BLEU, chrF, seconds, tokens (None on a process other than rank 0
    of a run in processes)."""
    trainer = TimedTrainer(run, run_dir, report=lambda line: print(f"  aiayn: {line}", flush=True), curve_s=curve_s)
    start, cpu = time.perf_counter(), time.process_time()
    result = trainer.fit()
    total, total_cpu = time.perf_counter() - start, time.process_time() - cpu
    if trainer.rank != 0:  # the other processes of a run in processes: rank 0 reports
        return None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    side = sum(trainer.side_seconds.values())
    bleu_at = {r["step"]: r.get("bleu") for r in rows if r["split"] == "valid"}
    # Training time = the run minus data preparation (tokenizer training, encoding: the peer's is outside
    # its timing too), validation, checkpoints and the test decoding.
    return {"bleu": result.test["bleu"], "chrf": result.test["chrf"], "steps": result.step,
            "processes": trainer.world, "batches": result.step * trainer.run.train.global_batches,
            "tokens": trainer.tokens, "train_s": total - side, "train_cpu_s": total_cpu - trainer.side_cpu,
            "side_s": side, "total_s": total,
            "valid": [(r["step"], r.get("bleu")) for r in rows if r["split"] == "valid"],
            "curve": [(round(seconds, 1), bleu_at[step]) for seconds, step in trainer.marks],
            "budget": result.budget, "loss": train_rows[-1]["loss"] if train_rows else math.nan}


# -- the peer ------------------------------------------------------------------------------------------

def marian_tokenizer(texts: list[str], vocab_size: int, min_frequency: int):
    """A SentencePiece-style BPE from `tokenizers` (NFKC, "▁" for spaces), with Marian's <pad>, </s>, <unk>."""
    from tokenizers import SentencePieceBPETokenizer

    tokenizer = SentencePieceBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=["<pad>", "</s>", "<unk>"], show_progress=False)
    return tokenizer


def marian_model(model_cfg, vocab_size: int, pad: int, eos: int):
    """`MarianMTModel` with aiayn's sizes and options (post-LN, ReLU, sinusoidal positions, tied embeddings)."""
    from transformers import MarianMTModel

    from aiayn.interop.marian import marian_config

    # Marian is post-LN with split sinusoids whatever aiayn uses (interleaved is a permutation of split)
    cfg = model_cfg.replace(vocab_size=vocab_size, tgt_vocab_size=None, pad_id=pad, pe_layout="split", norm_first=False)
    return MarianMTModel(marian_config(cfg, eos_token_id=eos))


def marian_decode(model, tokenizer, sources: list[str], *, beams: int, length_penalty: float, pad: int,
                  eos: int, max_tokens: int) -> list[str]:
    """Translate `sources` in length-sorted batches with `generate()`."""
    encoded = [tokenizer.encode(s).ids + [eos] for s in sources]
    out: dict[int, str] = {}
    model.eval()
    with torch.inference_mode():
        for batch in token_batches([len(e) for e in encoded], max_tokens // max(beams, 1), shuffle=False):
            width = max(len(encoded[i]) for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : len(encoded[i])] = torch.tensor(encoded[i])
            generated = model.generate(input_ids=ids, attention_mask=ids != pad, num_beams=beams, do_sample=False,
                                       max_new_tokens=width + 50, length_penalty=length_penalty,
                                       early_stopping=False)
            for row, i in enumerate(batch):
                out[i] = tokenizer.decode(generated[row].tolist(), skip_special_tokens=True)
    return [out[i] for i in range(len(sources))]


def train_marian(run, corpus: Path, *, seconds: float = 0.0, curve_s: float = 0.0) -> dict:
    """Train and test the peer with the run's sizes, batches, steps and recipe; BLEU, chrF, seconds, tokens.

    `seconds`: train for this many seconds of training (not steps); `curve_s`: validate each time the
    training seconds pass a multiple of it (instead of every `eval_every` steps).
    """
    cfg = run.train
    train, valid, test = (read_pairs(corpus / f"{name}.tsv") for name in ("train", "valid", "test"))
    tokenizer = marian_tokenizer([s for pair in train for s in pair], cfg.vocab_size, cfg.vocab_min_frequency)
    pad, eos = tokenizer.token_to_id("<pad>"), tokenizer.token_to_id("</s>")
    vocab = tokenizer.get_vocab_size()
    src = [e.ids + [eos] for e in tokenizer.encode_batch([s for s, _ in train])]
    tgt = [e.ids + [eos] for e in tokenizer.encode_batch([t for _, t in train])]
    keep = [i for i in range(len(train)) if len(src[i]) <= cfg.max_source_len and len(tgt[i]) <= cfg.max_target_len]
    src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
    lengths = [max(len(s), len(t)) for s, t in zip(src, tgt)]
    ties = [len(s) - len(t) for s, t in zip(src, tgt)]  # as aiayn's batches: alike on both sides
    torch.manual_seed(cfg.seed)
    model_cfg = run.model_config(vocab_size=vocab)
    model = marian_model(model_cfg, vocab, pad, eos)
    steps_per_epoch = len(token_batches(lengths, cfg.max_tokens, seed=cfg.seed, epoch=0, ties=ties))
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    if seconds and not cfg.max_steps:  # planned again after PROBE_STEPS timed steps; the clock ends the run
        total = 1000
    recipe, _ = resolve_recipe(cfg, total_steps=total, d_model=model_cfg.d_model)
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe.peak_lr, betas=recipe.betas, eps=recipe.eps,
                                 weight_decay=recipe.weight_decay, fused=True)
    print(f"  marian: {sum(p.numel() for p in model.parameters()):,} parameters, vocabulary {vocab}, "
          f"{len(src)} pairs, {total} steps; {recipe.describe()}", flush=True)
    step, epoch, train_s, train_cpu, side_s, tokens = 0, 0, 0.0, 0.0, 0.0, 0
    best, best_state, valid_curve = -1.0, None, []
    valid_sources = [s for s, _ in valid][: cfg.valid_max_examples or None]
    valid_refs = [t for _, t in valid][: cfg.valid_max_examples or None]
    marks: list[tuple[float, float]] = []
    while step < total or seconds:
        for batch in token_batches(lengths, cfg.max_tokens, seed=cfg.seed, epoch=epoch, ties=ties):
            start, cpu = time.perf_counter(), time.process_time()
            model.train()
            width_s, width_t = max(len(src[i]) for i in batch), max(len(tgt[i]) for i in batch)
            ids = torch.full((len(batch), width_s), pad, dtype=torch.long)
            labels = torch.full((len(batch), width_t), -100, dtype=torch.long)
            dec_in = torch.full((len(batch), width_t), pad, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : len(src[i])] = torch.tensor(src[i])
                labels[row, : len(tgt[i])] = torch.tensor(tgt[i])
                dec_in[row, 1 : len(tgt[i])] = torch.tensor(tgt[i][:-1])  # shifted right behind <pad>
            for group in optimizer.param_groups:
                group["lr"] = get_lr(step + 1, recipe, model_cfg.d_model)
            optimizer.zero_grad(set_to_none=True)
            logits = model(input_ids=ids, attention_mask=ids != pad, decoder_input_ids=dec_in,
                           decoder_attention_mask=dec_in != pad).logits
            n = int((labels != -100).sum())
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100,
                                   label_smoothing=cfg.label_smoothing, reduction="sum") / n
            loss.backward()
            if cfg.clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            optimizer.step()
            step += 1
            train_s += time.perf_counter() - start
            train_cpu += time.process_time() - cpu
            if seconds and not cfg.max_steps and step == PROBE_STEPS:  # the schedule fitted to the steps that fit
                total = max(int(seconds / (train_s / step)), step)
                recipe, _ = resolve_recipe(cfg, total_steps=total, d_model=model_cfg.d_model)
                print(f"  marian: {train_s / step:.3g} s a step: about {total} steps; {recipe.describe()}", flush=True)
            tokens += int((ids != pad).sum()) + n
            if step % cfg.log_every == 0:
                print(f"  marian: step {step} loss {loss.item():.3f} lr {get_lr(step, recipe, model_cfg.d_model):.2e} "
                      f"{tokens / train_s:.0f} tokens/s", flush=True)
            out_of_time = bool(seconds) and train_s >= seconds
            due = (train_s >= curve_s * (len(marks) + 1) if curve_s else cfg.eval_every and step % cfg.eval_every == 0)
            if due or out_of_time or (step == total and not seconds):
                start = time.perf_counter()
                hyps = marian_decode(model, tokenizer, valid_sources, beams=1, length_penalty=cfg.length_penalty,
                                     pad=pad, eos=eos, max_tokens=cfg.max_tokens)
                bleu = translation_scores(hyps, valid_refs, bleu_tokenize=cfg.bleu_tokenize)["bleu"]
                valid_curve.append((step, bleu))
                if curve_s and due:
                    marks.append((round(train_s, 1), bleu))
                if bleu > best:
                    best, best_state = bleu, {k: v.clone() for k, v in model.state_dict().items()}
                side_s += time.perf_counter() - start
                print(f"  marian: step {step} valid BLEU {bleu:.2f}", flush=True)
            if out_of_time or (step >= total and not seconds):
                break
        epoch += 1
        if out_of_time:
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    start = time.perf_counter()
    hyps = marian_decode(model, tokenizer, [s for s, _ in test], beams=cfg.num_beams,
                         length_penalty=cfg.length_penalty, pad=pad, eos=eos, max_tokens=cfg.max_tokens)
    side_s += time.perf_counter() - start
    scores = translation_scores(hyps, [t for _, t in test], bleu_tokenize=cfg.bleu_tokenize)
    return {"bleu": scores["bleu"], "chrf": scores["chrf"], "steps": step, "train_s": train_s,
            "train_cpu_s": train_cpu, "side_s": side_s,
            "total_s": train_s + side_s, "valid": valid_curve, "curve": marks if curve_s else [],
            "loss": float(loss.detach()), "tokens": tokens,
            "examples": list(zip([s for s, _ in test][:5], hyps[:5]))}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints a table and writes `results.json` into the work directory."""
    parser = argparse.ArgumentParser(prog="aiayn bench translate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="aiayn run config (default: examples/gettext-en-fr.toml)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps for both (default: the config's)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: the config's)")
    parser.add_argument("--lang", default=None, help="target language of the catalogs (default: fr); with "
                                                     "--corpus, the language its table names")
    parser.add_argument("--work", default=None, help="a new directory for the corpus, runs and results "
                                                     "(default: runs/bench-translate-N)")
    parser.add_argument("--corpus", default=None, help="an existing corpus directory (train/valid/test.tsv)")
    parser.add_argument("--skip-marian", action="store_true", help="train aiayn only")
    parser.add_argument("--skip-aiayn", action="store_true", help="train the peer only")
    parser.add_argument("--budget", default="", help="aiayn's time_budget (20m, 1h); the peer trains for the "
                                                     "training seconds aiayn had (default: --steps)")
    parser.add_argument("--curve", default="", help="validate both each time their training time passes a "
                                                    "multiple of this (5m): BLEU against training minutes")
    parser.add_argument("--layout", choices=("train", "threads"), default="train",
                        help="train: aiayn trains in the layout `aiayn train` takes (processes where measured "
                             "faster, or as `processes=N` says); threads: in this process, on threads")
    parser.add_argument("overrides", nargs="*", help="aiayn config overrides, applied to both (KEY=VALUE)")
    args = parser.parse_args(argv)
    work = Path(args.work) if args.work else new_work_dir("bench-translate")
    work.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus) if args.corpus else work / "corpus"
    lang = args.lang or "fr"
    if not prepare_corpus(corpus, lang):
        print(f"skipped: no compiled gettext catalogs for {lang!r} on this machine "
              f"(/usr/share/locale/{lang}/LC_MESSAGES/*.mo); nothing to train on", file=sys.stderr)
        return 0
    overrides = [f"train={corpus / 'train.tsv'}", f"valid={corpus / 'valid.tsv'}", f"test={corpus / 'test.tsv'}",
                 *args.overrides]
    if args.steps:
        overrides += [f"max_steps={args.steps}"] + ([] if args.budget else ["time_budget="])
    if args.threads:
        overrides.append(f"threads={args.threads}")
    if args.budget:
        overrides += [f"time_budget={args.budget}", "max_steps=0"]
    curve_s = parse_duration(args.curve) if args.curve else 0.0
    run = load_run_config(args.config or example_config("gettext-en-fr"), overrides)
    # The peer: the sizes aiayn's recipe fits to this corpus, its users' learning rate unless one is given
    fitted, _ = fit_run(run, len(read_pairs(corpus / "train.tsv")))
    peer = load_run_config(None, [*PEER_RECIPE, *(i for i in overrides if i.split("=")[0] in ("lr", "warmup"))],
                           base=fitted.to_dict())
    if "WORLD_SIZE" in os.environ:  # one of the processes `train_in_processes` started: train, rank 0 reports
        rank_result = train_aiayn(run, work / "aiayn", curve_s)
        if rank_result is not None:
            atomic_write_text(work / RANKS_RESULT, json.dumps(rank_result, ensure_ascii=False))
        return 0
    if run.train.threads:
        torch.set_num_threads(run.train.threads)
    results = {"config": run.to_dict(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    if not args.skip_aiayn:
        print("aiayn:", flush=True)
        laid_out, layout = resolved(run) if args.layout == "train" else (run, None)
        if laid_out.train.processes > 1:
            results["aiayn"] = train_in_processes(args, laid_out.train.processes, work, corpus, layout)
        else:
            results["aiayn"] = train_aiayn(run, work / "aiayn", curve_s)
        results["aiayn"]["layout"] = layout.why if layout is not None else (
            f"{laid_out.train.processes} processes" if laid_out.train.processes > 1 else f"{torch.get_num_threads()} "
                                                                                         "threads")
    if not args.skip_marian:
        peer = same_dropout(peer, work / "aiayn" / TRAIN_CONFIG, overrides)
        print("Hugging Face MarianMTModel:", flush=True)
        seconds = results["aiayn"]["train_s"] if args.budget and "aiayn" in results else (
            parse_duration(args.budget) if args.budget else 0.0)
        results["marian"] = train_marian(peer, corpus, seconds=seconds, curve_s=curve_s)
    (work / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    pair = pair_name(corpus, args.lang if args.corpus else lang)
    source = f", gettext catalogs ({corpus})" if (corpus / "corpus.json").is_file() or not args.corpus else ""
    print(f"\n{pair}{source}; {torch.get_num_threads()} threads; beam {run.train.num_beams}")
    if "aiayn" in results:
        print(f"aiayn trained as {results['aiayn']['layout']}; the peer on {results['threads']} threads")
    print(f"{'':8} {'steps':>6} {'batches':>8} {'tokens/s':>9} {'BLEU':>6} {'chrF':>6} {'train s':>8} "
          f"{'train CPU s':>12} {'valid+test s':>13}")
    for name in ("aiayn", "marian"):
        if name in results:
            r = results[name]
            print(f"{name:8} {r['steps']:>6} {r.get('batches', r['steps']):>8} {rate(r):>9.0f} {r['bleu']:>6.2f} "
                  f"{r['chrf']:>6.2f} {r['train_s']:>8.0f} {r['train_cpu_s']:>12.0f} {r['side_s']:>13.0f}")
    if "aiayn" in results and "marian" in results:
        a, m = results["aiayn"], results["marian"]
        print(f"BLEU difference {a['bleu'] - m['bleu']:+.2f}; training time aiayn / Marian: wall "
              f"{a['train_s'] / m['train_s']:.2f}, CPU {a['train_cpu_s'] / m['train_cpu_s']:.2f} (the CPU seconds of "
              f"rank 0 where aiayn trains in processes); tokens a second aiayn / Marian {rate(a) / rate(m):.2f}")
    for name in ("aiayn", "marian"):
        if name in results:
            r = results[name]
            figure(name, r["bleu"], "BLEU", split="test")
            figure(name, r["chrf"], "chrF", split="test")
            figure(name, r["steps"], "steps")
            figure(name, r.get("batches", r["steps"]), "batches")
            figure(name, rate(r), "tokens/s")
            for seconds, bleu in r["curve"]:
                figure(name, bleu, "BLEU", split="valid", minutes=round(seconds / 60, 2))
    if curve_s:
        print_curves(pair, results, curve_s)
    return 0


def same_dropout(peer, saved: Path, overrides: list[str]):
    """The peer's config with the dropout aiayn's recipe chose for its run (`saved`, its `train_config.json`: a fitted
    recipe fits it to the compute once the run knows its pace), unless the overrides set one for both."""
    if not saved.is_file() or any(item.startswith("model.dropout=") for item in overrides):
        return peer
    dropout = json.loads(saved.read_text(encoding="utf-8"))["model"].get("dropout")
    return peer if dropout is None else replace(peer, model_overrides={**peer.model_overrides, "dropout": dropout})


def rate(result: dict) -> float:
    """Real tokens trained a second of training time."""
    return result["tokens"] / max(result["train_s"], 1e-9)


def print_curves(pair: str, results: dict, curve_s: float) -> None:
    """Validation BLEU (greedy) at each multiple of `curve_s` seconds of training, aiayn and the peer side by side."""
    curves = {name: results[name]["curve"] for name in ("aiayn", "marian") if name in results}
    print(f"\n{pair}: validation BLEU (greedy) after this much training time")
    print(f"{'training':>10} " + " ".join(f"{name:>8}" for name in curves))
    for k in range(max(len(c) for c in curves.values())):
        cells = [f"{c[k][1]:>8.2f}" if k < len(c) else f"{'':>8}" for c in curves.values()]
        print(f"{format_duration(curve_s * (k + 1)):>10} " + " ".join(cells))
    ends = {name: results[name]["valid"][-1][1] for name in curves if results[name]["valid"]}
    seconds = max(results[name]["train_s"] for name in curves)
    cells = " ".join(f"{ends.get(name, math.nan):>8.2f}" for name in curves)
    print(f"{'end ' + format_duration(seconds):>10} {cells}  (the last validation, after all training)")


def train_in_processes(args: argparse.Namespace, processes: int, work: Path, corpus: Path, layout) -> dict:
    """aiayn's side trained as `aiayn train` trains in processes: `processes` ranks of this benchmark, one thread
    each, started as `aiayn train processes=N` starts its own; rank 0's figures."""
    from aiayn.cli.processes import train_processes

    if layout is not None:
        print(f"  aiayn: training as {layout.why}", flush=True)
    argv = ["bench", "translate", "--work", str(work), "--corpus", str(corpus), "--skip-marian",
            *(["--config", args.config] if args.config else []), *(["--steps", str(args.steps)] if args.steps else []),
            *(["--budget", args.budget] if args.budget else []), *(["--curve", args.curve] if args.curve else []),
            *(o for o in args.overrides if o.split("=")[0] not in ("processes", "threads")),
            f"processes={processes}", "threads=0"]  # the ranks do not decide again; the launcher gives one thread
    code = train_processes(argv, processes, threads=0)
    if code != 0:
        raise SystemExit(f"aiayn's {processes} training processes failed (exit code {code}); see their output above")
    return json.loads((work / RANKS_RESULT).read_text(encoding="utf-8"))


if __name__ == "__main__":
    sys.exit(main())
