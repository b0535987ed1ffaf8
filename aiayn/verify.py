"""`aiayn verify`: the oracle comparisons, run on this machine and device, on every path it can use.

After a new CPU, GPU or PyTorch version this is how a user knows the fast paths still compute the
paper's model. Each check builds a tiny seeded model, runs it the way one path runs it (the plain
modules of `aiayn.nn`, or a copy prepared by `aiayn.backends`) and measures the largest difference
from an oracle computed in float32 on the CPU (float64 for the NumPy reference):

- each encoder and decoder layer, and both stacks, against `torch.nn.TransformerEncoderLayer` /
  `TransformerDecoderLayer` / `TransformerEncoder` / `TransformerDecoder` with copied weights;
- the whole encoder-decoder and an encoder-only model against the NumPy reference (`aiayn.reference`);
- where `transformers` is installed, the whole model against `MarianMTModel` and `BertModel` with
  the same weights, and greedy and beam-4 decoding against Marian's `generate()`;
- decoding on the key/value cache against recomputing every step;
- on training paths, the loss and every gradient against plain autograd (the largest difference in float32; in bf16,
  all gradients as one vector, the L2 norm of the difference relative to theirs).

Tolerances: float32 as the tests use them; bf16 and int8 paths are approximate by design and may
differ by a fraction of the largest expected value (`RELATIVE_FLOOR`, set for int8's full activation
range and scaled by the activation step where the CPU needs the reduced one).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from aiayn import reference
from aiayn.backends import Backend, bf16_supported, calibrate, cpu, resolve_device, select
from aiayn.config import ModelConfig
from aiayn.interop.torch_nn import (
    copy_decoder_layer,
    copy_encoder_layer,
    to_torch_decoder,
    to_torch_encoder,
    torch_decoder_layer,
    torch_encoder_layer,
)
from aiayn.nn.model import build_decoder, build_encoder, build_model
from aiayn.tasks import SEQ2SEQ

# Approximate paths may differ by this fraction of the largest expected value.
RELATIVE_FLOOR = {"fp32": 0.0, "bf16": 0.05, "int8": 0.15}
LAYER_VARIANTS = {"post-LN ReLU": dict(norm_first=False, activation="relu"),
                  "pre-LN GELU": dict(norm_first=True, activation="gelu")}
# Tiny, but wide enough (d_ff 256) that oneDNN and MKL sum in different orders: the paths really differ.
TINY = dict(vocab_size=40, d_model=64, n_heads=4, d_ff=256, n_encoder_layers=2, n_decoder_layers=2, max_len=32,
            dropout=0.0)


@dataclass(frozen=True)
class Check:
    """One comparison: on which path, against which oracle, the largest difference and what is allowed."""

    path: str
    name: str
    max_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        """Finite and within the tolerance."""
        return math.isfinite(self.max_diff) and self.max_diff <= self.tolerance


def paths(device: str | torch.device | None = None) -> list[Backend]:
    """The plain path and every backend path this machine can use on `device`, in inference and training:
    those `select` takes here, and on CPU the oneDNN paths it takes where those are faster."""
    device = resolve_device(device)
    found = [select(device, "inference", "fp32", plain=True), select(device, "inference", "fp32"),
             select(device, "train", "fp32")]
    if bf16_supported(device):
        found += [select(device, "inference", "bf16"), select(device, "train", "bf16")]
    if device.type == "cpu":
        found.append(select(device, "inference", "int8"))
        if cpu.onednn_usable():  # the kernels other machines choose, checked here too
            found += [Backend(device, "inference", "fp32", onednn=True, prepack=True, fused_qkv=True,
                              kernels=cpu.kernel_triples(calibrate.by_shape(cpu.DEFAULT_KERNELS))),
                      Backend(device, "train", "fp32", onednn=True, fused_qkv=True)]
    unique = {backend.describe(): backend for backend in found}
    return list(unique.values())


def verify(device: str | torch.device | None = None, *,
           progress: Callable[[Backend], None] | None = None) -> list[Check]:
    """Run every check on every path of `device` (default: the best available); `progress` hears of each path."""
    checks = []
    for backend in paths(device):
        if progress is not None:
            progress(backend)
        checks += list(_checks(backend))
    return checks


# -- running a module on a path ----------------------------------------------------------------


def _run(backend: Backend, module: nn.Module, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
    """The module as `backend` prepares it, called on the inputs as the path runs (dropout off; no gradients
    for inference, autograd and autocast for training); the output in float32 on the CPU.

    Inputs move to the device; float ones take the dtype of the prepared states (bf16 for a bf16 copy).
    """
    device, dtype = backend.device, _dtype(backend)

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, dtype) if t.is_floating_point() else t.to(device)

    prepared = backend.prepare(module).eval()
    with torch.enable_grad() if backend.mode == "train" else torch.no_grad(), backend.autocast():
        out = prepared(*map(place, args), **{name: place(t) for name, t in kwargs.items()})
    return out.detach().float().cpu()


def _dtype(backend: Backend) -> torch.dtype:
    """The dtype of the states a prepared copy takes (a bf16 inference copy has bf16 weights)."""
    return torch.bfloat16 if backend.precision == "bf16" and backend.mode == "inference" else torch.float32


def _compare(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max |actual - expected|, max |expected|)."""
    expected = expected.detach().double().cpu()
    return float((actual.double() - expected).abs().max()), float(expected.abs().max())


def _randomised(module: nn.Module) -> nn.Module:
    """LayerNorm gains/biases and projection biases away from (1, 0), so that a mis-copied one shows."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3)
    return module.eval()


def _real(lengths: list[int], length: int) -> torch.Tensor:
    """(B, L) bool, True for the first lengths[b] positions of row b (right padding)."""
    return torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]


# -- the checks ----------------------------------------------------------------------------------


@dataclass
class _Case:
    """A module, its inputs and its oracle's output (computed once), compared on every path."""

    name: str
    module: nn.Module
    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, torch.Tensor]
    expected: torch.Tensor
    keep: torch.Tensor | None  # compare only these positions (what padded positions hold does not matter)
    tolerance: float


def _floor(backend: Backend) -> float:
    """The relative difference an approximate path may show: int8's grows with its activation step."""
    if backend.precision != "int8":
        return RELATIVE_FLOOR[backend.precision]
    from aiayn.backends.int8 import int8_range, step_ratio

    return RELATIVE_FLOOR["int8"] * step_ratio(int8_range() == "reduced")


def _checks(backend: Backend) -> Iterator[Check]:
    floor = _floor(backend)
    label = backend.describe()
    for case in _oracle_cases():
        actual = _run(backend, case.module, *case.args, **case.kwargs)
        expected = case.expected
        if case.keep is not None:
            actual, expected = actual[case.keep], expected[case.keep]
        diff, scale = _compare(actual, expected)
        yield Check(label, case.name, diff, max(case.tolerance * max(scale, 1.0), floor * scale))
    for name, (diff, scale), tolerance in (*_decoding_checks(backend), *_gradient_checks(backend)):
        yield Check(label, name, diff, max(tolerance * max(scale, 1.0), floor * scale))


@functools.cache
def _oracle_cases() -> tuple[_Case, ...]:
    """Every module-against-oracle case, built once per process (tiny, seeded)."""
    return (*_torch_nn_cases(), *_reference_cases(), *_hugging_face_cases())


def _torch_nn_cases() -> Iterator[_Case]:
    for variant, options in LAYER_VARIANTS.items():
        cfg = ModelConfig(**TINY, **options)
        torch.manual_seed(0)
        x, memory = torch.randn(3, 7, cfg.d_model), torch.randn(3, 6, cfg.d_model)
        keep, src_keep = _real([7, 4, 1], 7), _real([6, 2, 4], 6)
        look_ahead = torch.ones(7, 7, dtype=torch.bool).triu(1)  # torch: True = may NOT attend
        with torch.no_grad():
            layer = _randomised(build_encoder(cfg).layers[0])
            theirs = torch_encoder_layer(cfg).eval()
            copy_encoder_layer(layer, theirs)
            yield _Case(f"encoder layer = torch.nn.TransformerEncoderLayer ({variant}, padded)", layer,
                        (x, keep[:, None, None, :]), {}, theirs(x, src_key_padding_mask=~keep), keep, 1e-5)

            layer = _randomised(build_decoder(cfg).layers[0])
            theirs = torch_decoder_layer(cfg).eval()
            copy_decoder_layer(layer, theirs)
            expected = theirs(x, memory, tgt_mask=look_ahead, tgt_is_causal=True, memory_key_padding_mask=~src_keep)
            yield _Case(f"decoder layer = torch.nn.TransformerDecoderLayer ({variant}, padded)", layer, (x, memory),
                        {"memory_mask": src_keep[:, None, None, :]}, expected, None, 1e-5)

            encoder = _randomised(build_encoder(cfg))
            expected = to_torch_encoder(encoder, cfg).eval()(x, src_key_padding_mask=~keep)
            yield _Case(f"encoder stack = torch.nn.TransformerEncoder ({variant}, padded)", encoder,
                        (x, keep[:, None, None, :]), {}, expected, keep, 1e-5)

            decoder = _randomised(build_decoder(cfg))
            expected = to_torch_decoder(decoder, cfg).eval()(x, memory, tgt_mask=look_ahead, tgt_is_causal=True,
                                                             memory_key_padding_mask=~src_keep)
            yield _Case(f"decoder stack = torch.nn.TransformerDecoder ({variant}, padded)", decoder, (x, memory),
                        {"memory_mask": src_keep[:, None, None, :]}, expected, None, 1e-5)


def _seq2seq_batch(vocab: int, tgt_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(4, vocab, (3, 7))
    src[1, 4:] = 0  # right padding
    src[2, 2:] = 0
    return src, torch.randint(4, tgt_vocab, (3, 5))


def _bert_like() -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(**{**TINY, "n_decoder_layers": 0}, positional="learned", activation="gelu", type_vocab_size=2,
                      embedding_norm=True, scale_embeddings=False, layer_norm_eps=1e-12)
    return _randomised(build_model(cfg))


def _reference_cases() -> Iterator[_Case]:
    for variant, options in LAYER_VARIANTS.items():
        torch.manual_seed(0)
        cfg = ModelConfig(**TINY, **options)
        model = _randomised(build_model(cfg))
        src, tgt = _seq2seq_batch(cfg.vocab_size, cfg.target_vocab_size)
        expected = torch.from_numpy(reference.forward(reference.export_weights(model), cfg, src.numpy(), tgt.numpy()))
        yield _Case(f"encoder-decoder logits = NumPy reference ({variant})", model, (src, tgt), {}, expected, None,
                    1e-5)
    model = _bert_like()
    ids, mask = torch.randint(4, model.config.vocab_size, (2, 6)), _real([6, 3], 6).long()
    expected = torch.from_numpy(reference.encoder_hidden_states(reference.export_weights(model), model.config,
                                                                ids.numpy(), mask.numpy()))
    yield _Case("encoder-only hidden states = NumPy reference (BERT-like)", model, (ids,), {"attention_mask": mask},
                expected, mask.bool(), 1e-5)


def _marian_like(seed: int) -> nn.Module:
    """A tiny Marian-shaped model whose greedy and beam outputs depend on the source (sharper attention)."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**{**TINY, "vocab_size": 24}, pe_layout="split")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(0.2 if "feed_forward" in name else 4.0 if "attn" in name else 3.0)
    return model


def _hugging_face_cases() -> Iterator[_Case]:
    if importlib.util.find_spec("transformers") is None:
        return
    import transformers

    from aiayn.interop.bert import bert_state_dict, config_to_bert
    from aiayn.interop.marian import to_marian

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = _randomised(build_model(ModelConfig(**TINY, pe_layout="split")))
    src, tgt = _seq2seq_batch(TINY["vocab_size"], TINY["vocab_size"])
    with torch.no_grad():
        expected = to_marian(model)(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt).logits
    yield _Case("encoder-decoder logits = Hugging Face MarianMTModel", model, (src, tgt), {}, expected, None, 1e-4)

    model = _bert_like()
    bert = transformers.BertModel(transformers.BertConfig(**config_to_bert(model.config)),
                                  add_pooling_layer=False).eval()
    bert.load_state_dict(bert_state_dict(model), strict=False)
    ids, mask = torch.randint(4, model.config.vocab_size, (2, 6)), _real([6, 3], 6).long()
    with torch.no_grad():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state
    yield _Case("encoder-only hidden states = Hugging Face BertModel", model, (ids,), {"attention_mask": mask},
                expected, mask.bool(), 1e-4)


def _decoding_checks(backend: Backend) -> Iterator[tuple[str, float, float]]:
    if backend.mode != "inference":
        return
    from aiayn.inference.generation import GenerationConfig, generate

    device = backend.device
    model = _marian_like(1)
    src, _ = _seq2seq_batch(24, 24)
    hf = None
    if importlib.util.find_spec("transformers") is not None and backend.precision == "fp32":
        from aiayn.interop.marian import to_marian

        hf = to_marian(model, decoder_start_token_id=1, eos_token_id=2)  # before the model moves to the device
    prepared = backend.prepare(model)
    steps = 8
    worst = _cached_against_recomputed(prepared, src.to(device), steps, flat=False)
    yield "decoding on the modules' key/value cache = recomputing every step (logits)", worst, 1e-5
    # The steps a search runs (inference.steps' flat step over a static cache), on two short sentences, the second
    # padded: where the backend absorbs cross-attention into the memory (backends.absorbed), this is the absorbed
    # step, mask and all.
    short = src[1:, :4].to(device)  # (2, 4): 4 real tokens, and 2 then padding
    worst = _cached_against_recomputed(prepared, short, steps, flat=True)
    yield "decoding steps (the flat step, static cache) = recomputing every step (logits)", worst, 1e-5
    yield ("decoder-only decoding (the same flat step) = recomputing every step (logits)",
           _continued_against_recomputed(backend, steps), 1e-5)
    if hf is None:
        return  # token-by-token equality is for exact paths; approximate ones may pick another near-tie
    for beam in (1, 4):
        config = GenerationConfig(max_new_tokens=steps, min_len=steps, num_beams=beam, length_penalty=0.6)
        ours = generate(prepared, src.to(device), bos_id=1, eos_id=2, config=config).tokens
        with torch.no_grad():
            out = hf.generate(input_ids=src, attention_mask=(src != 0).long(), num_beams=beam, do_sample=False,
                              max_new_tokens=steps, min_new_tokens=steps, length_penalty=0.6, early_stopping=False)
        theirs = [row[1:].tolist() for row in out]
        differing = sum(a != b for a, b in zip(ours, theirs))
        yield f"{'greedy' if beam == 1 else 'beam-4'} decoding = Hugging Face generate() (sentences differing)", \
            (float(differing), 0.0), 0.0


@torch.no_grad()
def _cached_against_recomputed(model: nn.Module, src: torch.Tensor, steps: int, *, flat: bool) -> tuple[float, float]:
    """(max difference, scale) of the next-token logits over `steps` greedy steps decoded on a key/value cache
    (with `flat`, the step a search runs, `inference.steps.start`; else the modules' `decode`) against
    recomputing the whole prefix at each step."""
    from aiayn.inference.steps import ModuleState, start

    memory_mask = model.source_mask(src)
    memory = model.encode(src, memory_mask)
    state = start(model, src, steps) if flat else ModuleState(model, src)
    prefix, worst = torch.full((src.shape[0], 1), 1, device=src.device), (0.0, 0.0)
    for _ in range(steps):
        logits = state.step(prefix[:, -1:])
        full = model.head(model.decode(prefix, memory, memory_mask=memory_mask))[:, -1]
        worst = max(worst, _compare(logits.cpu(), full))
        prefix = torch.cat([prefix, full.argmax(-1, keepdim=True)], dim=1)
    return worst


@torch.no_grad()
def _continued_against_recomputed(backend: Backend, steps: int) -> tuple[float, float]:
    """(max difference, scale) of a decoder-only model's next-token logits over `steps` greedy steps on the step a
    search runs (`inference.steps.start_causal`, the prompt's keys and values in the static cache) against running
    the model over the whole sequence at each step."""
    from aiayn.inference.steps import start_causal

    torch.manual_seed(3)
    model = _randomised(build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0, "causal": True})))
    prepared = backend.prepare(model)
    ids = torch.randint(3, TINY["vocab_size"], (2, 3), generator=torch.Generator().manual_seed(4))
    ids = ids.to(backend.device)
    state, worst = start_causal(prepared, ids, steps), (0.0, 0.0)
    for _ in range(steps):
        logits = state.step(ids[:, -1:])
        full = prepared(ids)[:, -1].float()
        worst = max(worst, _compare(logits.cpu(), full.cpu()))
        ids = torch.cat([ids, full.argmax(-1, keepdim=True)], dim=1)
    return worst


def _gradient_checks(backend: Backend) -> Iterator[tuple[str, float, float]]:
    if backend.mode != "train":
        return
    from aiayn.training.loss import label_smoothed_loss
    from aiayn.training.objectives import forward

    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY)).train()
    src, tgt = _seq2seq_batch(TINY["vocab_size"], TINY["vocab_size"])
    labels = tgt.clone()
    labels[1, 3:] = -100

    def step(module: nn.Module, device: torch.device, autocast) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        batch = {"src": src.to(device), "tgt_in": tgt.to(device), "labels": labels.to(device)}
        with autocast:
            logits, kept = forward(module, batch, SEQ2SEQ)
        loss, _ = label_smoothed_loss(logits.float(), kept, smoothing=0.1)
        loss.backward()
        return float(loss.detach()), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}

    plain_loss, plain_grads = step(model, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    loss, grads = step(backend.prepare(model).train(), backend.device, backend.autocast())
    model.cpu()
    yield "training loss = plain autograd on the CPU", (abs(loss - plain_loss), abs(plain_loss)), 1e-5
    if backend.precision == "fp32":
        scale = max(float(g.abs().max()) for g in plain_grads.values())
        worst = max(_compare(grads[n], g)[0] for n, g in plain_grads.items()) / scale
        yield "training gradients = plain autograd on the CPU (relative to the largest)", (worst, 1.0), 1e-5
        return
    # Under autocast a ReLU whose input rounds across zero moves single gradient entries by several percent of the
    # largest (bf16's plain path: 2-7% over 12 seeded models, docs/notes.md, "Training"): the gradients are held
    # together, as one vector, to the floor.
    expected = torch.cat([g.double().flatten() for g in plain_grads.values()])
    actual = torch.cat([grads[n].double().flatten() for n in plain_grads])
    relative = float((actual - expected).norm() / expected.norm())
    yield "training gradients = plain autograd on the CPU (L2 distance relative to theirs)", (relative, 1.0), 1e-5


def format_checks(checks: list[Check]) -> str:
    """The checks as a table, grouped by path."""
    lines, current = [], None
    width = max(len(c.name) for c in checks)
    for check in checks:
        if check.path != current:
            current = check.path
            lines.append(f"== {current}")
        mark = "ok" if check.ok else "FAIL"
        lines.append(f"  {check.name:<{width}}  {check.max_diff:9.2e}  <= {check.tolerance:7.1e}  {mark}")
    failed = sum(not c.ok for c in checks)
    lines.append(f"{len(checks) - failed} of {len(checks)} checks passed" + (f"; {failed} FAILED" if failed else ""))
    return "\n".join(lines)
