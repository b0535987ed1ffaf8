"""Translating a test file with a trained run: aiayn against the run's own CTranslate2 export.

Run: `aiayn bench file --run RUN --data test.tsv [--threads 1] [--searches greedy,beam-4] [--precisions fp32,int8]`.

`aiayn bench generate` times one random base-size model on forced lengths; this is the work a user does with
what they trained: real sentences of every length, each ending where its search ends, batches of sentences of
similar length, a small model and vocabulary (what a run of minutes trains). In one run it

- loads the run as `aiayn translate` does (`Translator`, the machine's backend for each precision) and exports
  it to CTranslate2 (`aiayn.interop.ctranslate2`, the same conversion as `aiayn export --ctranslate2`; int8
  as CTranslate2's `int8` weights);
- translates the file's sources with each engine in turn, in a rotating order, `--repeats` times: both batch by
  padded source tokens (`--max-tokens`, aiayn's default; CTranslate2's `max_batch_size` with `batch_type`
  tokens), beam search with length penalty 0.6, outputs up to the longest source + 50 tokens (at most the
  model's positions). CTranslate2 runs twice: on the whole file in one call, batched its own way, its outputs
  up to the file's longest source + 50 tokens; and on aiayn's own batches, one call each, outputs up to each
  batch's longest source + 50, as aiayn bounds each sentence by its own source + 50. The second is the same work
  on both sides: with the file's limit for every sentence, CTranslate2 decodes the sentences that never end
  further (a third more output tokens on a small model's test file, docs/notes.md, "Decoding");
- prints each engine's seconds for the file (best repeat), sentences a second, the ratios of aiayn's speed to
  CTranslate2's at the same precision (median of per-repeat ratios), and each output's BLEU and chrF against
  the file's references (sacrebleu), since the two searches may stop differently.

`--data` is a TSV of source and reference per line (as `aiayn corpus` writes), or a text file of sources (no BLEU).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from interleave import interleaved  # benchmarks/interleave.py
from record import figure  # benchmarks/record.py

SEARCHES = {"greedy": 1, "beam-4": 4}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a run or model directory of a translation model")
    p.add_argument("--data", required=True, help="TSV of source<TAB>reference (or one source per line)")
    p.add_argument("--threads", type=int, default=None, help="torch and CTranslate2 threads (default: torch's)")
    p.add_argument("--searches", default="greedy,beam-4", help="greedy, beam-4 or both (default)")
    p.add_argument("--precisions", default="fp32",
                   help="comma-separated: fp32, int8, bf16 (default fp32; bf16 beside CTranslate2 fp32, which has no "
                        "bf16 on CPU)")
    p.add_argument("--repeats", type=int, default=2, help="timed translations of the file per engine (2)")
    p.add_argument("--limit", type=int, default=0, help="the first N sentences only (0: all)")
    p.add_argument("--max-tokens", type=int, default=4096, help="padded source tokens per batch (4096)")
    return p


def read_pairs(path: Path, limit: int) -> tuple[list[str], list[str] | None]:
    """Sources and references (None when the file has one column)."""
    rows = [line.rstrip("\n").split("\t") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    sources = [row[0] for row in rows]
    references = [row[1] for row in rows] if rows and all(len(row) > 1 for row in rows) else None
    return sources, references


def aiayn_engine(translator, max_tokens: int, threads: int | None = None):
    """A function that translates a list of texts as `aiayn translate` does, beam search with length penalty 0.6, on
    `threads` threads (the count is set at each call: creating a CTranslate2 engine sets the OpenMP thread count of
    the thread that creates it to its `intra_threads`)."""
    from aiayn.inference.generation import GenerationConfig

    def translate(texts: list[str], beam: int) -> list[str]:
        if threads is not None:
            torch.set_num_threads(threads)
        return translator.translate(texts, GenerationConfig(num_beams=beam, length_penalty=0.6), max_tokens=max_tokens)

    return translate


def ctranslate2_engines(translator, directory: Path, precision: str, threads: int, max_tokens: int):
    """Two functions that translate a list of texts with the run's CTranslate2 export (the export's pieces in, the
    target tokenizer's text out): the whole list in one call, batched CTranslate2's way, and aiayn's batches one
    call each. On more than one thread its batches run side by side, one thread each (`inter_threads`), as aiayn's
    do (`Translator.translations`)."""
    import ctranslate2

    from aiayn.data.batching import token_batches
    from aiayn.interop.ctranslate2 import source_tokens, to_ctranslate2

    to_ctranslate2(translator.model, translator.source_tokenizer, directory,
                   target_tokenizer=translator.target_tokenizer, quantization="int8" if precision == "int8" else None)
    engine = ctranslate2.Translator(str(directory), device="cpu", compute_type="int8" if precision == "int8"
                                    else "float32", intra_threads=1, inter_threads=threads)
    source, target = translator.source_tokenizer, translator.target_tokenizer
    limit = translator.model.config.max_len  # aiayn's limits: the same

    def longest(pieces: list[list[str]]) -> int:
        return min(max(map(len, pieces)) + 50, limit)

    def translate(pieces: list[list[str]], beam: int, batches: list[list[int]] | None = None) -> list[str]:
        if batches is None:
            results = engine.translate_batch(pieces, beam_size=beam, length_penalty=0.6, max_batch_size=max_tokens,
                                             batch_type="tokens", max_decoding_length=longest(pieces))
        else:
            results = [None] * len(pieces)
            running = []  # every batch handed over at once: the engine's workers take them in turn
            for batch in batches:
                group = [pieces[i] for i in batch]
                running.append((batch, engine.translate_batch(group, beam_size=beam, length_penalty=0.6,
                                                              max_decoding_length=longest(group), asynchronous=True)))
            for batch, found in running:
                for i, result in zip(batch, found):
                    results[i] = result.result()
        return target.decode_batch([[target.hf.token_to_id(p) for p in r.hypotheses[0]] for r in results])

    def whole(texts: list[str], beam: int) -> list[str]:
        return translate([source_tokens(source, text) for text in texts], beam)

    def on_aiayns_batches(texts: list[str], beam: int) -> list[str]:
        ids = translator.encode(texts)  # aiayn's source ids, batched as `Translator.translations` batches them
        pieces = [[source.id_to_token(i) for i in row] or source_tokens(source, text)  # an empty text: `</s>`
                  for row, text in zip(ids, texts)]
        return translate(pieces, beam, [list(b) for b in token_batches([len(row) for row in ids], max_tokens,
                                                                       shuffle=False)])

    return whole, on_aiayns_batches


def scores(outputs: list[str], references: list[str] | None) -> str:
    """BLEU (sacrebleu's 13a tokenizer) and chrF of `outputs`, as the trainer scores them; "" without references."""
    if references is None:
        return ""
    from aiayn.tasks.metrics import translation_scores

    found = translation_scores(outputs, references, bleu_tokenize="13a")
    return f"BLEU {found['bleu']:5.2f}  chrF {found['chrf']:5.2f}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table; returns 0."""
    from aiayn.inference.translator import Translator

    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    sources, references = read_pairs(Path(args.data), args.limit)
    searches = [(name, SEARCHES[name]) for name in args.searches.split(",") if name in SEARCHES]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    try:
        import ctranslate2
    except ImportError:
        ctranslate2 = None
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for precision in precisions:
            torch.set_num_threads(threads)  # a CTranslate2 engine created before left this thread on its own count
            translator = Translator.from_pretrained(args.run, device="cpu", precision=precision)
            engines[f"aiayn {precision}"] = aiayn_engine(translator, args.max_tokens, threads)
            if ctranslate2 is not None and precision != "bf16":  # CTranslate2 has no bf16 on CPU: fp32 is its peer
                own, same = ctranslate2_engines(translator, Path(tmp) / precision, precision, threads, args.max_tokens)
                engines[f"CTranslate2 {precision}"] = own
                engines[f"CTranslate2 {precision}, aiayn's batches"] = same
        cfg = translator.model.config
        words = sum(len(s.split()) for s in sources)
        print(f"{args.run}: d_model {cfg.d_model}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, vocabulary "
              f"{cfg.target_vocab_size}; {len(sources)} sentences ({words} words) of {args.data}; torch "
              f"{torch.__version__}, {threads} threads"
              + (f", CTranslate2 {ctranslate2.__version__}" if ctranslate2 else ", CTranslate2 not installed"))
        print(f"seconds for the file: best of {args.repeats} rotating repeats; ratio: median of per-repeat ratios")
        for search, beam in searches:
            outputs, fns = {}, {}
            for name, engine in engines.items():
                fns[name] = lambda name=name, engine=engine, beam=beam, outputs=outputs: outputs.__setitem__(
                    name, engine(sources, beam))
                engine(sources[:32], beam)  # warm up: the backend's first calls, CTranslate2's first batch
            times = interleaved(fns, args.repeats)
            for name in engines:
                best = min(times[name])
                print(f"{search:<7} {name:<33} {best:8.2f} s  {len(sources) / best:8.1f} sentences/s  "
                      f"{scores(outputs[name], references)}", flush=True)
                figure(name, len(sources) / best, "sentences/s", search=search)
            for precision in precisions:
                ours, peer = f"aiayn {precision}", "fp32" if precision == "bf16" else precision
                for theirs, what in ((f"CTranslate2 {peer}", f"aiayn {precision} / CTranslate2 {peer}"),
                                     (f"CTranslate2 {peer}, aiayn's batches",
                                      f"aiayn {precision} / CTranslate2 {peer} on aiayn's batches"),
                                     ("aiayn fp32", f"aiayn {precision} / aiayn fp32")):
                    if theirs == ours:
                        continue
                    if theirs in times:
                        ratio = statistics.median(t / o for o, t in zip(times[ours], times[theirs]))
                        print(f"{search:<7} {what}: {ratio:.2f}x", flush=True)
                        figure(what, ratio, "x", search=search)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
