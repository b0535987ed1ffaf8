"""Decoding and averaging levers of a trained translation run, scored on the first pairs of a split.

    python benchmarks/levers.py RUN CORPUS_DIR [--split valid] [--pairs 500] [--threads 1]

Prints one JSON line per setting: greedy, beam 4 with length penalty 0.6 (the default) and 1.0, beam 8,
and the average of the run's last three checkpoints with beam 4 (sacreBLEU 13a and chrF).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import sacrebleu
import torch

import aiayn
from aiayn.data.readers import read_parallel
from aiayn.training.checkpoint import average_checkpoints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a seq2seq run directory written by aiayn train")
    parser.add_argument("corpus", help="a directory with train/valid/test.tsv")
    parser.add_argument("--split", default="valid", choices=["valid", "test"])
    parser.add_argument("--pairs", type=int, default=500, help="the first N pairs of the split")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pairs = read_parallel(str(Path(args.corpus) / f"{args.split}.tsv"))[0][: args.pairs]  # as `aiayn eval` reads
    sources, references = [p.source for p in pairs], [p.target for p in pairs]
    translator = aiayn.load(args.run)

    def score(name: str, **search) -> None:
        start = time.perf_counter()
        hypotheses = translator.translate(sources, **search)
        seconds = time.perf_counter() - start
        refs = [references]
        print(json.dumps({"setting": name, "bleu": round(sacrebleu.corpus_bleu(hypotheses, refs).score, 2),
                          "chrf": round(sacrebleu.corpus_chrf(hypotheses, refs).score, 2),
                          "seconds": round(seconds, 1)}), flush=True)

    score("greedy", num_beams=1)
    score("beam 4, length penalty 0.6", num_beams=4, length_penalty=0.6)
    score("beam 4, length penalty 1.0", num_beams=4, length_penalty=1.0)
    score("beam 8, length penalty 0.6", num_beams=8, length_penalty=0.6)
    checkpoints = sorted((Path(args.run) / "checkpoints").glob("step-*"))[-3:]
    if checkpoints:
        average_checkpoints(translator.model, checkpoints)  # the translator prepares the new weights again
        score(f"average of {', '.join(c.name for c in checkpoints)}, beam 4, 0.6", num_beams=4, length_penalty=0.6)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
