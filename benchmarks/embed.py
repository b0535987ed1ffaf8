"""Sentence-embedding speed: aiayn's Embedder beside sentence-transformers and Hugging Face BertModel.

All three run all-MiniLM-L6-v2 with the same weights on the same generated corpus, and their
vectors are compared (max abs difference, min cosine) so the speeds are for equal outputs.

    python benchmarks/embed.py --sentences 2000        # or: aiayn bench embed --sentences 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

import numpy as np
import torch
from interleave import interleaved  # benchmarks/interleave.py
from record import figure  # benchmarks/record.py

_SUBJECTS = ["The committee", "A small café in Zürich", "My neighbour's dog", "The quantum computer",
             "Every student", "The old lighthouse keeper", "This algorithm", "The orchestra", "Nobody",
             "The naïve researcher", "A fleet of électric buses", "The government"]
_VERBS = ["announced", "rejected", "painted", "measured", "forgot", "celebrated", "questioned", "translated",
          "optimised", "repaired", "described", "predicted"]
_OBJECTS = ["the results of the experiment", "a new policy on renewable energy", "the broken bicycle",
            "an unexpectedly long list of requirements", "the résumé", "the weather", "its own limitations",
            "a symphony by Dvořák", "the incomprehensibilities of bureaucracy", "the stock market"]
_TAILS = ["yesterday", "after a long debate", "without telling anyone", "in 2019", "because it was raining",
          "with remarkable precision", "despite the objections of several experts in the field", "again",
          "— to everyone's surprise —", "while the city slept", "at 3:45 p.m.", "for the third time this week"]


def make_corpus(n: int, seed: int = 0) -> list[str]:
    """`n` varied English sentences (3 to ~70 words, accents, punctuation, numbers), deterministic."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 5, 8])):
            parts.append(rng.choice(_TAILS))
            if rng.random() < 0.3:
                parts.append(f"and {rng.choice(_SUBJECTS).lower()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}")
        if rng.random() < 0.15:
            parts = parts[:2]
        out.append(" ".join(parts) + rng.choice([".", "!", "?", "...", f" (#{i})."]))
    return out


def real_sentences(n: int) -> list[str]:
    """Up to `n` real English sentences of 3+ words: the msgids of this machine's French gettext catalogs
    (menu items, messages, help lines; see `aiayn.data.gettext`), sorted; empty without catalogs."""
    from aiayn.data.gettext import read_gettext

    try:
        corpus = read_gettext("fr")
    except (FileNotFoundError, ValueError):
        return []
    texts = {ex.source for split in (corpus.train, corpus.valid, corpus.test) for ex in split}
    return sorted(t for t in texts if len(t.split()) >= 3)[:n]


def _compare(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(np.abs(a - b).max()), float(cos.min())


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table; returns 0, or 1 if the fp32 outputs disagree."""
    parser = argparse.ArgumentParser(prog="benchmarks.embed", description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=2000, help="corpus size (default 2000)")
    parser.add_argument("--batch-size", type=int, default=16, help="aiayn batch size (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the corpus per pipeline")
    parser.add_argument("--latency-calls", type=int, default=50, help="calls timed for batch-1 latency")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the best available)")
    parser.add_argument("--real", type=int, default=1000,
                        help="also compare vectors on this many real sentences (gettext msgids; 0: skip)")
    parser.add_argument("--precisions", default="fp32,plain,bf16,int8",
                        help="aiayn variants to run: fp32 (always), plain (fp32, the model's modules as written, "
                             "without the backend's oneDNN and fused Q/K/V), bf16, int8 (default: all four)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer, BertModel

    from aiayn.inference.embeddings import Embedder
    from aiayn.interop.bert import package_model_dir

    model_dir = package_model_dir()
    corpus = make_corpus(args.sentences)
    short = "How are you today?"
    ours = Embedder.from_pretrained(device=args.device)
    device = ours.backend.device
    st = SentenceTransformer(str(model_dir), device=str(device))
    st_batch = 32  # sentence-transformers' default batch size
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    hf = BertModel.from_pretrained(model_dir, attn_implementation="sdpa").to(device).eval()

    def hf_embed(texts: list[str], batch_size: int = 32) -> np.ndarray:
        """The textbook pipeline: tokenize, BertModel, mean-pool, normalise (length-sorted like ST)."""
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = np.empty((len(texts), hf.config.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                batch = hf_tok([texts[i] for i in idx], padding=True, truncation=True, max_length=256,
                               return_tensors="pt")
                hidden = hf(**batch.to(device)).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                vec = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out[idx] = torch.nn.functional.normalize(vec, dim=1).cpu().numpy()
        return out

    runs: dict[str, Callable[[list[str]], np.ndarray]] = {
        "sentence-transformers": lambda t: st.encode(t, batch_size=st_batch, convert_to_numpy=True),
        "HF BertModel (sdpa)": hf_embed,
        "aiayn": lambda t: ours.embed(t, batch_size=args.batch_size),
    }
    for precision in args.precisions.split(","):
        if precision.strip() == "plain":
            plain = Embedder(ours.model, ours.tokenizer, pooling=ours.pooling, normalize=ours.normalize,
                             max_length=ours.max_length, device=device, plain=True)
            runs["aiayn fp32 plain"] = lambda t, v=plain: v.embed(t, batch_size=args.batch_size)
        if precision.strip() == "bf16" or (precision.strip() == "int8" and device.type == "cpu"):
            variant = ours.with_precision(precision.strip())
            runs[f"aiayn {precision.strip()}"] = lambda t, v=variant: v.embed(t, batch_size=args.batch_size)

    reference = runs["sentence-transformers"](corpus)
    tokens = sum(len(ids) for ids in ours.tokenize(corpus))
    print(f"corpus: {len(corpus)} sentences, {tokens} tokens; torch threads {torch.get_num_threads()}; "
          f"{args.repeats} interleaved repeats (throughput: best repeat; ratios: median of per-repeat ratios)")
    agreement = {name: _compare(fn(corpus), reference) for name, fn in runs.items()}
    throughput = interleaved({name: (lambda fn=fn: fn(corpus)) for name, fn in runs.items()}, args.repeats)
    for _ in range(3):  # warm-up for the latency runs
        for fn in runs.values():
            fn([short])
    latency = interleaved({name: (lambda fn=fn: fn([short])) for name, fn in runs.items()}, args.latency_calls)
    real = real_sentences(args.real) if args.real else []
    real_cos: dict[str, float] = {}
    if real:
        real_reference = runs["sentence-transformers"](real)
        real_cos = {name: _compare(fn(real), real_reference)[1] for name, fn in runs.items()}
    print(f"{'pipeline':<24}{'sent/s':>10}{'batch-1 ms':>12}{'max|diff|':>12}{'min cos':>10}"
          + (f"{f'min cos, {len(real)} real':>22}" if real else ""))
    ok = True
    for name in runs:
        diff, cos = agreement[name]
        rate = len(corpus) / min(throughput[name])
        ms = statistics.median(latency[name]) * 1e3
        print(f"{name:<24}{rate:>10.1f}{ms:>12.2f}{diff:>12.2e}{cos:>10.6f}"
              + (f"{real_cos[name]:>22.6f}" if real else ""))
        figure(name, rate, "sentences/s")
        figure(name, ms, "ms", batch=1)
        if name in ("sentence-transformers", "HF BertModel (sdpa)", "aiayn", "aiayn fp32 plain"):
            ok &= diff <= 1e-5 and min(cos, real_cos.get(name, 1.0)) >= 0.99999

    def ratio(name: str, base: str, table: dict[str, list[float]]) -> float:
        return statistics.median(b / a for a, b in zip(table[name], table[base]))  # speed-up of name over base

    print(f"aiayn throughput vs sentence-transformers: {ratio('aiayn', 'sentence-transformers', throughput):.2f}x "
          "(target >= 1.1x)")
    figure("aiayn throughput vs sentence-transformers", ratio("aiayn", "sentence-transformers", throughput), "x")
    print(f"aiayn batch-1 latency vs HF BertModel: {1 / ratio('aiayn', 'HF BertModel (sdpa)', latency):.2f}x "
          "(target <= 0.5x)")
    if "aiayn fp32 plain" in runs:
        print(f"backend ({ours.backend.describe()}): throughput {ratio('aiayn', 'aiayn fp32 plain', throughput):.2f}x, "
              f"batch-1 latency {1 / ratio('aiayn', 'aiayn fp32 plain', latency):.2f}x of the plain fp32 model")
    for name in ("aiayn bf16", "aiayn int8"):
        if name in runs:
            print(f"{name[6:]}: throughput vs aiayn fp32 {ratio(name, 'aiayn', throughput):.2f}x, vs "
                  f"sentence-transformers {ratio(name, 'sentence-transformers', throughput):.2f}x; batch-1 latency "
                  f"vs HF {1 / ratio(name, 'HF BertModel (sdpa)', latency):.2f}x; min cos to sentence-transformers "
                  f"{min(agreement[name][1], real_cos.get(name, 1.0)):.5f} (target: >= 1.5x fp32 with min cos >= 0.99, "
                  "batch-1 latency <= 0.5x HF)")
    if not ok:
        print("fp32 outputs disagree beyond tolerance (max diff 1e-5, cos 0.99999)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
