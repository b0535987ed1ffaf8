"""Decoding speed: aiayn `generate()` beside CTranslate2 and Hugging Face `MarianMTModel.generate()`, same weights.

Contenders, each in fp32 and (where it has one) int8:
- aiayn: the backend's prepared copy (`select(device, "inference", precision).prepare(model)`), as
  `aiayn translate --precision P` runs it;
- CTranslate2 (optional extra `ctranslate2`), the C++ engine behind OPUS-MT / Argos deployments:
  the model goes through the Marian export and CTranslate2's own converter, `float32` and `int8`;
- Hugging Face `MarianMTModel.generate()` (fp32).
Random weights rarely emit `</s>`, so every side is forced to produce exactly `--new-tokens` tokens
(min length = max length) and does equal work. Each setting times all contenders in turn, in a
rotating order, `--repeats` times: tokens/s are the best repeat, ratios the median of the per-repeat
ratios (the same moment's load on both sides). Each batch-1 figure is also given as a share of the memory
bound measured on this machine (`bandwidth.py`: B / bytes a step reads, in each contender's precision).
Also times single greedy steps at output position 16
and 256: with the key/value cache a step costs work linear in the prefix, so the two are close.

    python benchmarks/generate.py [--quick] [--threads N] [--device D]     (or: aiayn bench generate --quick)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bandwidth import bound_tokens_per_second, measure, step_parameters  # benchmarks/bandwidth.py
from interleave import interleaved  # benchmarks/interleave.py
from record import figure  # benchmarks/record.py

from aiayn.backends import select
from aiayn.config import preset
from aiayn.inference.generation import GenerationConfig, generate
from aiayn.inference.steps import start as start_decoding
from aiayn.nn.model import build_model

BOS, EOS, PAD = 1, 2, 0
SEARCHES = (("greedy", 1), ("beam-4", 4))


def ctranslate2_export(model, directory: Path, quantization: str) -> Path:
    """`model` as a CTranslate2 model directory, through the Marian export and CTranslate2's converter.

    A stand-in until `aiayn export` writes CTranslate2 models (`aiayn.interop.ctranslate2`): the
    vocabulary is made-up piece names. CTranslate2's Marian loader drops the last vocabulary row
    (where Hugging Face's Marian keeps `<pad>`; it starts the decoder from a zero embedding instead),
    so the last id is named `<pad>` here and CTranslate2's output layer has one row fewer (36,999 of
    37,000: the same work within 0.003%). Sources must avoid that id.
    """
    from ctranslate2.converters import TransformersConverter

    from aiayn.interop.marian import to_marian

    hf = to_marian(model, decoder_start_token_id=BOS, eos_token_id=EOS)
    vocab = {piece_name(i): i for i in range(model.config.vocab_size - 1)} | {"<pad>": model.config.vocab_size - 1}

    class _Vocabulary:  # what the converter reads from a tokenizer
        eos_token, unk_token = piece_name(EOS), piece_name(3)

        @staticmethod
        def get_vocab() -> dict[str, int]:
            return vocab

    class _Converter(TransformersConverter):
        def load_model(self, *args, **kwargs):
            return hf

        def load_tokenizer(self, *args, **kwargs):
            return _Vocabulary()

    config_dir = directory / "marian-config"
    hf.config.save_pretrained(config_dir)  # the converter reads the configuration from a directory
    out = directory / f"ctranslate2-{quantization}"
    _Converter(str(config_dir)).convert(str(out), quantization=quantization, force=True)
    return out


def piece_name(i: int) -> str:
    """The made-up vocabulary entry of id `i` that CTranslate2 reads and writes."""
    return {0: "<blank>", 1: "<s>", 2: "</s>", 3: "<unk>"}.get(i, f"t{i}")


def _contenders(engines: dict, src: torch.Tensor, beam: int, new_tokens: int) -> dict[str, Callable[[], None]]:
    """One call per contender decoding `src` with `beam` to exactly `new_tokens` tokens (checked)."""
    # No scores asked of greedy search: CTranslate2's `translate_batch` and Hugging Face's `generate` compute none
    config = GenerationConfig(max_new_tokens=new_tokens, min_len=new_tokens, num_beams=beam, length_penalty=0.6,
                              return_scores=False)
    pieces = [[piece_name(i) for i in row] for row in src.tolist()]
    fns: dict[str, Callable[[], None]] = {}
    for name, engine in engines.items():
        if name.startswith("aiayn"):
            def fn(model=engine):
                out = generate(model, src, bos_id=BOS, eos_id=EOS, config=config)
                assert all(len(t) == new_tokens for t in out.tokens)
        elif name.startswith("CTranslate2"):
            def fn(translator=engine):
                out = translator.translate_batch(pieces, beam_size=beam, max_decoding_length=new_tokens,
                                                 min_decoding_length=new_tokens, length_penalty=0.6)
                assert all(len(r.hypotheses[0]) == new_tokens for r in out)
        else:
            def fn(hf=engine):
                out = hf.generate(input_ids=src, attention_mask=torch.ones_like(src), num_beams=beam,
                                  do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  length_penalty=0.6, early_stopping=False)
                assert out.shape[1] == new_tokens + 1
        fns[name] = fn
    return fns


@torch.inference_mode()
def _step_times(model, positions: tuple[int, ...], device: torch.device, window: int = 8) -> dict[int, float]:
    """Median seconds of one greedy step (batch 1) around each output position, as `generate()` runs them."""
    src = torch.randint(4, model.config.vocab_size, (1, 16), device=device)
    last = max(positions) + window
    state = start_decoding(model, src, last)
    token = torch.full((1, 1), BOS, device=device)
    times: dict[int, list[float]] = {p: [] for p in positions}
    for step in range(last):
        begin = time.perf_counter()
        token = state.step(token).argmax(-1, keepdim=True)
        int(token)  # wait for the device
        elapsed = time.perf_counter() - begin
        for p in positions:
            if p - window // 2 <= step < p + window // 2:
                times[p].append(elapsed)
    return {p: sorted(v)[len(v) // 2] for p, v in times.items()}  # median of the window


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the decoding benchmark."""
    parser = argparse.ArgumentParser(prog="aiayn bench generate", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and one repeat (under a minute)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per sentence (32; quick 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch (and CTranslate2) threads (default: torch's)")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--searches", default="greedy,beam-4", help="greedy, beam-4 or both (default)")
    parser.add_argument("--preset", default="base", help="model size (base; tiny for a smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per setting, contenders in turn (5)")
    parser.add_argument("--precisions", default="fp32,int8",
                        help="comma-separated: fp32, int8 (CPU only), bf16 (where native: a GPU, AVX-512-BF16, AMX)")
    parser.add_argument("--peers", default="ctranslate2,hf",
                        help="ctranslate2 (if installed), hf (Hugging Face Marian), both (default) or none")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the best available)")
    return parser


def _engines(plain, args, workdir: Path) -> tuple[dict, str]:
    """The contenders' models by name, and a line saying what each is."""
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    peers = {p.strip() for p in args.peers.split(",") if p.strip()} - {"none"}
    engines: dict = {}
    notes = []
    for precision in precisions:
        backend = select(args.device, "inference", precision)
        engines[f"aiayn {precision}"] = backend.prepare(plain)
        notes.append(f"aiayn {precision}: {backend.describe()}")
        if backend.cuda_graphs:  # the same steps launched one kernel at a time, to show what the graphs give
            engines[f"aiayn {precision} eager"] = dataclasses.replace(backend, cuda_graphs=False).prepare(plain)
    device = select(args.device, "inference").device
    if "ctranslate2" in peers:
        try:
            import ctranslate2
        except ImportError:
            notes.append("CTranslate2 not installed (pip install 'aiayn[ctranslate2]')")
        else:
            where = "cuda" if device.type == "cuda" else "cpu"
            supported = ctranslate2.get_supported_compute_types(where)  # no bfloat16 on a CPU
            for precision in precisions:
                quantization = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}[precision]
                if quantization not in supported:
                    notes.append(f"CTranslate2 has no {quantization} on {where}")
                    continue
                path = ctranslate2_export(plain, workdir, quantization)
                engines[f"CTranslate2 {precision}"] = ctranslate2.Translator(
                    str(path), device=where, compute_type=quantization, intra_threads=torch.get_num_threads(),
                    inter_threads=1)
            notes.append(f"CTranslate2 {ctranslate2.__version__}")
    if "hf" in peers:
        import transformers

        from aiayn.interop.marian import to_marian

        transformers.logging.set_verbosity_error()
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            if precision == "fp32" or precision in precisions:
                marian = to_marian(plain, decoder_start_token_id=BOS, eos_token_id=EOS)
                engines[f"HF {precision}"] = marian.to(device, dtype)
        notes.append(f"transformers {transformers.__version__}")
    return engines, "; ".join(notes)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table; returns 0."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    repeats = 1 if args.quick else args.repeats
    torch.manual_seed(0)
    cfg = preset(args.preset).replace(pe_layout="split", dropout=0.0)
    plain = build_model(cfg).eval()
    searches = [(name, beam) for name, beam in SEARCHES if name in args.searches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        engines, notes = _engines(plain, args, Path(tmp))
        backend = select(args.device, "inference")  # the fp32 backend: its device, and whether it folds
        device = backend.device
        print(f"{args.preset} model (d_model {cfg.d_model}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, "
              f"vocab {cfg.vocab_size}), source 16 tokens, {new_tokens} new tokens forced, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads; {notes}")
        print(f"tokens/s: best of {repeats} rotating repeats; ratios: median of per-repeat ratios")
        bandwidth = _bandwidths(cfg, device)
        names = list(engines)
        print(f"{'search':<8} {'batch':>5} " + " ".join(f"{n:>17}" for n in names) + "   ratios")
        for batch in (int(b) for b in args.batches.split(",")):
            # The last id is CTranslate2's <pad> (see ctranslate2_export): sources avoid it.
            src = torch.randint(4, cfg.vocab_size - 1, (batch, 16), device=device)
            for search, beam in searches:
                fns = _contenders(engines, src, beam, new_tokens)
                with torch.inference_mode():
                    for fn in fns.values():
                        fn()  # warm up every contender
                    times = interleaved(fns, repeats)
                rates = " ".join(f"{batch * new_tokens / min(times[n]):>17.1f}" for n in names)
                print(f"{search:<8} {batch:>5} {rates}   {_ratios(times)}", flush=True)
                for n in names:
                    figure(n, batch * new_tokens / min(times[n]), "tokens/s", search=search, batch=batch)
                for label, value in _ratio_values(times).items():
                    figure(label, value, "x", search=search, batch=batch)
                if batch == 1:  # the precision is a contender's second word ("aiayn fp32 eager", "HF bf16")
                    shares = {n: new_tokens / min(times[n]) / bound_tokens_per_second(bandwidth, cfg, n.split()[1])
                              for n in names if n.split()[1] in ("fp32", "bf16", "int8")}
                    print(f"{'':<14} of the bound: " + ", ".join(f"{n} {share:.0%}" for n, share in shares.items()),
                          flush=True)
                    for n, share in shares.items():
                        figure(n, 100 * share, "%", search=search, batch=batch, measure="share of the memory bound")
    positions = (16, 64) if args.quick else (16, 256)
    model = engines.get("aiayn fp32") or next(iter(engines.values()))
    step = _step_times(model, positions, device)
    a, b = positions
    fixed = "; a CUDA graph's step attends over its whole cache at every position" \
        if device.type == "cuda" and getattr(model, "cuda_graphs", False) else ""
    print(f"greedy step time at output position {a}: {step[a] * 1e3:.2f} ms, at {b}: {step[b] * 1e3:.2f} ms "
          f"(ratio {step[b] / step[a]:.2f} for {b / a:.0f}x the prefix{fixed})")
    if backend.absorbed_cross:
        print(_absorbing(plain, backend, device))
    return 0


def _bandwidths(cfg, device: torch.device):
    """This machine's streaming bandwidth over a buffer of the step's fp32 size, at the bench's threads (returned)
    and at every core (a GPU's: on the GPU), printed with the bound in tokens/s it sets for each precision."""
    threads = torch.get_num_threads()
    nbytes = step_parameters(cfg) * 4
    if device.type == "cuda":
        at, used, precisions, where = {0: measure(nbytes, device=device)}, 0, ("fp32", "bf16"), "on the GPU"
    else:
        at, used, precisions, where = {threads: measure(nbytes)}, threads, ("fp32", "bf16", "int8"), \
            f"at {threads} thread(s)"
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if cores != threads:
            torch.set_num_threads(cores)
            at[cores] = measure(nbytes)
            torch.set_num_threads(threads)
    for key, bandwidth in at.items():
        figure("memory bound", bandwidth.best / 1e9, "GB/s", **({"device": "cuda"} if key == 0 else {"threads": key}))
    bound = ", ".join(f"{p} {bound_tokens_per_second(at[used], cfg, p):.0f}" for p in precisions)
    print(f"memory bound: a step reads {step_parameters(cfg) / 1e6:.1f} M weights; streaming "
          + "; ".join(b.describe() for b in at.values()) + f"; {where} at most {bound} tokens/s at batch 1")
    return at[used]


def _absorbing(plain, backend, device: torch.device, rounds: int = 7) -> str:
    """A line comparing greedy steps at batch 1 with cross-attention absorbed into the memory and without."""
    absorbed = backend.prepare(plain)
    separate = dataclasses.replace(backend, absorbed_cross=False).prepare(plain)
    pairs = [(_step_times(separate, (16,), device)[16], _step_times(absorbed, (16,), device)[16])
             for _ in range(rounds)]
    plain_ms, absorbed_ms = (min(p[i] for p in pairs) * 1e3 for i in (0, 1))
    gain = statistics.median(a / b for a, b in pairs)
    return (f"greedy step at batch 1 (16 source tokens), cross-attention absorbed into the memory: "
            f"{absorbed_ms:.2f} ms against {plain_ms:.2f} ms without ({gain:.3f}x, median of {rounds} paired rounds)")


def _ratio_values(times: dict[str, list[float]]) -> dict[str, float]:
    """aiayn's speed over each peer's at the same precision (and int8 over fp32), per-repeat medians, by label."""
    def ratio(ours: str, theirs: str) -> float:
        return statistics.median(t / o for o, t in zip(times[ours], times[theirs]))

    pairs = {"fp32 vs CT2": ("aiayn fp32", "CTranslate2 fp32"), "int8 vs CT2": ("aiayn int8", "CTranslate2 int8"),
             "bf16 vs CT2": ("aiayn bf16", "CTranslate2 bf16"), "bf16 vs CT2 fp32": ("aiayn bf16", "CTranslate2 fp32"),
             "bf16 vs fp32": ("aiayn bf16", "aiayn fp32"), "fp32 vs HF": ("aiayn fp32", "HF fp32"),
             "bf16 vs HF": ("aiayn bf16", "HF bf16"), "int8 vs fp32": ("aiayn int8", "aiayn fp32"),
             "graphs vs eager fp32": ("aiayn fp32", "aiayn fp32 eager"),
             "graphs vs eager bf16": ("aiayn bf16", "aiayn bf16 eager")}
    return {label: ratio(*pair) for label, pair in pairs.items() if pair[0] in times and pair[1] in times}


def _ratios(times: dict[str, list[float]]) -> str:
    """`_ratio_values` as the table prints them."""
    return ", ".join(f"{label} {value:.2f}x" for label, value in _ratio_values(times).items())


if __name__ == "__main__":
    raise SystemExit(main())
