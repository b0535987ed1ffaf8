"""Decoding speed: aiayn `generate()` beside Hugging Face `MarianMTModel.generate()` with the same weights.

Random weights rarely emit `</s>`, so both sides are forced to produce exactly `--new-tokens` tokens
(min length = max length) and do equal work. Also times single decoding steps at output position
16 and 256: with the key/value cache a step costs work linear in the prefix, so the two are close.

    python benchmarks/generate.py [--quick] [--threads N] [--device D]     (or: aiayn bench generate --quick)
"""

from __future__ import annotations

import argparse
import time

import torch

from aiayn.backends import select
from aiayn.config import preset
from aiayn.inference.generation import GenerationConfig, generate
from aiayn.nn.model import build_model

BOS, EOS, PAD = 1, 2, 0


def _best_times(fns, repeats: int) -> list[float]:
    """Fastest of `repeats` runs of each function, the functions taking turns (load hits both alike)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _compare(model, hf, batch: int, beam: int, new_tokens: int, src_len: int, repeats: int) -> tuple[float, float]:
    """Tokens/s (batch x new tokens / seconds) of aiayn and Hugging Face for one setting."""
    src = torch.randint(4, model.config.vocab_size, (batch, src_len), device=hf.device)
    config = GenerationConfig(max_len=new_tokens, min_len=new_tokens, beam_size=beam, length_penalty=0.6)

    def ours():
        out = generate(model, src, bos_id=BOS, eos_id=EOS, config=config)
        assert all(len(t) == new_tokens for t in out.tokens)

    def theirs():
        out = hf.generate(input_ids=src, attention_mask=torch.ones_like(src), num_beams=beam, do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, length_penalty=0.6,
                          early_stopping=True)
        assert out.shape[1] == new_tokens + 1

    with torch.inference_mode():
        ours()  # warm up both
        theirs()
        t_ours, t_hf = _best_times([ours, theirs], repeats)
    return batch * new_tokens / t_ours, batch * new_tokens / t_hf


@torch.inference_mode()
def _step_times(model, positions: tuple[int, ...], device: torch.device, window: int = 8) -> dict[int, float]:
    """Median seconds of one greedy step (batch 1) around each output position, with the KV cache."""
    src = torch.randint(4, model.config.vocab_size, (1, 16), device=device)
    mask = model.source_mask(src)
    memory = model.encode(src, mask)
    cache = model.new_cache()
    token = torch.full((1, 1), BOS, device=device)
    times: dict[int, list[float]] = {p: [] for p in positions}
    last = max(positions) + window
    for step in range(last):
        start = time.perf_counter()
        hidden = model.decode(token, memory, memory_mask=mask, cache=cache)
        token = model.head(hidden[:, -1]).argmax(-1, keepdim=True)
        int(token)  # wait for the device
        elapsed = time.perf_counter() - start
        for p in positions:
            if p - window // 2 <= step < p + window // 2:
                times[p].append(elapsed)
    return {p: sorted(v)[len(v) // 2] for p, v in times.items()}  # median of the window


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table; returns 0."""
    parser = argparse.ArgumentParser(prog="benchmarks.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and one repeat (under a minute)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per sentence (32; quick 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--preset", default="base", help="model size (base; tiny for a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting, aiayn and HF in turn (3)")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the best available)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from aiayn.interop.marian import to_marian

    transformers.logging.set_verbosity_error()
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    repeats = 1 if args.quick else args.repeats
    torch.manual_seed(0)
    cfg = preset(args.preset).replace(pe_layout="split", dropout=0.0)
    plain = build_model(cfg).eval()
    hf = to_marian(plain, decoder_start_token_id=BOS, eos_token_id=EOS)
    backend = select(args.device, "inference")
    model = backend.prepare(plain)  # as `aiayn translate` runs it
    hf.to(backend.device)
    print(f"{args.preset} model (d_model {cfg.d_model}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, "
          f"vocab {cfg.vocab_size}), source 16 tokens, {new_tokens} new tokens forced, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"backend {backend.describe()}")
    print(f"{'search':<8} {'batch':>5} {'aiayn tok/s':>12} {'HF tok/s':>10} {'speed-up':>9}")
    for batch in (int(b) for b in args.batches.split(",")):
        for name, beam in (("greedy", 1), ("beam-4", 4)):
            ours, theirs = _compare(model, hf, batch, beam, new_tokens, 16, repeats)
            print(f"{name:<8} {batch:>5} {ours:>12.1f} {theirs:>10.1f} {ours / theirs:>8.2f}x", flush=True)
    positions = (16, 64) if args.quick else (16, 256)
    times = _step_times(model, positions, backend.device)
    a, b = positions
    print(f"greedy step time at output position {a}: {times[a] * 1e3:.2f} ms, at {b}: {times[b] * 1e3:.2f} ms "
          f"(ratio {times[b] / times[a]:.2f} for {b / a:.0f}x the prefix)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
