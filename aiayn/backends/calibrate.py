"""Which CPU products are faster on this machine: measured once, cached per machine, read by `select`.

What is fast on one CPU is slow on another. On AMD processors with AVX-512, MKL (PyTorch's default
for a float32 `F.linear`) skips its AVX-512 kernels and oneDNN runs about twice as fast; on an
AVX2-only CPU PyTorch's default wins. A one-row product (a decoding step at batch 1) and a few-row
one (beam 4) can go either way again, and differently for a layer that widens its input (FFN up,
stacked Q/K/V, the vocabulary projection) than for one that narrows it (FFN down): on an AVX2 EPYC,
MKL's product over the transposed weight streams a widening one-row product about twice as fast as
`F.linear`, and a narrowing one slower. So nothing is assumed: `choices()` times each candidate on
each shape kind of a base model's layers (`shapes.SHAPE_KINDS`: d_model 512, d_ff 2048) and keeps the plain
kernel unless another is at least `timing.MARGIN` faster (median of per-repeat ratios).

    kernel      computes x W^T + b with
    "dense"     F.linear over W as stored (out, in): PyTorch's default, the plain path
    "columns"   torch.mm over a copy of W transposed, (in, out) contiguous (MKL's matrix-vector product)
    "packed"    oneDNN over W reordered once into its blocked layout (`torch.ops.mkldnn`)
    "aten"      F.linear over W as stored with oneDNN off: PyTorch's own kernels (bf16 inference only, where a
                bf16 F.linear would otherwise go to oneDNN over the unpacked weight)

Inference products are chosen per number of rows (`shapes.ROW_CLASSES`: one, a few, many) and per shape
kind (`shapes.shape_kind`: wide, square, narrow, vocabulary), each timed at `shapes.rows_measured` rows (many at 256,
the vocabulary's many at a decoding batch's 64), in float32 and, on a CPU with native bf16, in bf16
(`bf16_kernels`); training
products (forward and backward) are oneDNN or F.linear; fused Q/K/V (one stacked product instead of
three) is kept only where measured faster, in each mode.

A kernel replaces the plain one only where it is faster by more than `timing.MARGIN` in at least three
repeats of four (interleaved, so a busy moment hits every candidate alike): a win smaller than its
own spread is no win. The result is cached in `cache_dir()` under a key of what changes it: the CPU
model and features, the PyTorch version, the thread count and the ISA-limiting environment
variables; a cache older than the backend's code, or measured while other work held the cores the
measurement needed, is measured again. Measure again by hand with `choices(refresh=True)`,
`aiayn verify --recalibrate` or `AIAYN_RECALIBRATE=1`; `aiayn verify` prints what was chosen, with
each choice's median and lower-quartile speed-up.

Only what is asked for is measured: a model narrower than a base one has its products, fused Q/K/V, encoder
layers and int8 products measured at its own widths (`inference_kernels`, `inference_layers`,
`int8_weight_choices`, `int8_kernels`, about a second each at a short recipe's widths), a training run its own
shapes (`training_choices`); a base model's shapes (`choices`, a few seconds) are measured the first time a
base-wide model or `aiayn verify` asks. A first `aiayn translate` with a small model does not wait for shapes it
does not have.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends import cpu, dropout, int8, timing
from aiayn.backends.fused import TorchEncoderLayer, fuse_qkv, stacked_away
from aiayn.backends.shapes import FEW_ROWS_MAX, ROW_CLASSES, SHAPE_KINDS, rows_measured
from aiayn.config import ModelConfig, preset
from aiayn.nn.model import build_encoder, build_model
from aiayn.paths import locked, read_regular_file
from aiayn.rundir import atomic_write_text

logger = logging.getLogger(__name__)

TRAIN_ROWS = 256
# A model's own training products are timed on at most this many rows (larger batches behave alike, time slowly).
TRAIN_SHAPE_ROWS = 4096
# A decoding step reads every weight of the model once: one- and few-row products are timed over enough copies of
# a shape to hold the model's bytes, at most this many (more than a CPU's last-level cache), each pass right after
# its own (`_cold_copies`), so that a base model's weights are read from memory and a narrow model's from the cache,
# as its steps read them.
COLD_BYTES = 64 << 20
ENVIRONMENT = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "AIAYN_INT8_RANGE")
FORMAT = 11  # bump when what is measured changes (3: kernels by shape kind as well as rows; 4: fused layers;
#            5: the vocabulary projection as a shape kind of its own; 6: a win must hold in 3 of 4 repeats;
#            7: int8 weights against the float32 kernels; the training choices of a shape are added when asked;
#            8: one- and few-row products timed each pass right after its own; 9: a decoding step's and an
#            encoding's threads timed on the model itself; 10: an int8 layer's product by rows, oneDNN's among them;
#            11: the vocabulary's many rows timed at a decoding batch's 64, not 256)
# PyTorch's fused encoder layer replaces the layer written out where at least this much faster (the two run
# the same products, so the difference is small and steady: the rest of each layer's passes)
LAYER_MARGIN = 0.01
LAYER_REPEATS = 11


def by_shape(per_rows: dict[str, str]) -> dict[str, dict[str, str]]:
    """A kernel per row class, the same for every shape kind: {"one": {"wide": k, ...}, ...}."""
    return {rows: dict.fromkeys((kind for kind, _ in SHAPE_KINDS), kernel) for rows, kernel in per_rows.items()}


@dataclass(frozen=True)
class Choices:
    """What `select` uses on this machine, and the timings that decided it.

    Attributes:
        inference: kernel per row class ("one", "few", "many") and shape kind ("wide", "square", "narrow",
            "vocabulary")
            for float32 inference products: `inference["one"]["wide"]`.
        train_onednn: float32 training products (forward and backward) on oneDNN instead of F.linear.
        fused_qkv_inference, fused_qkv_train: Q, K and V as one stacked product, by mode.
        torch_layers_inference: encoder layers on many rows run PyTorch's fused layer (`fused.TorchEncoderLayer`).
            These five, a base model's shapes, are None until something asks for them (`choices`).
        seconds: the best time of each candidate, by "what: kernel".
        machine: the description the cache key was made from.
        load: how many cores other programs kept busy while it was measured (`timing.competing`), the most of any
            of its measurements: other work competing for the cores skews the ratios, and a file measured busy is
            measured again once the machine is quieter (`timing.measured_busy`).
        int8_weights: by row class ("one", "few") and shape kind, whether a product over int8 weights
            (`int8.Int8WeightsLinear`) ran faster than the float32 kernel chosen there (int8 inference uses it for
            layers whose activations int8 cannot hold); None until int8 inference first asks
            (`int8_weight_choices`), so that float32 users do not wait for it.
        training: by "rows x d_model x d_ff", [products on oneDNN, Q/K/V stacked] for training a model of those
            widths (`training_choices`); measured the first time a run of that shape asks.
        inference_widths: by "d_model x d_ff x vocabulary", the inference kernels (as `inference`) for a model of
            those widths (`inference_kernels`); measured the first time a model of that shape is prepared.
        inference_layers: by "d_model x d_ff x vocabulary", [Q/K/V stacked, PyTorch's fused encoder layer] for
            inference on a model of those widths (`inference_layers`), as `fused_qkv_inference` and
            `torch_layers_inference` at a base model's.
        int8_weights_widths: by "d_model x d_ff x vocabulary", `int8_weights` for a model of those widths
            (`int8_weight_choices` with its shape).
        bf16_widths: by "d_model x d_ff x vocabulary", the bf16 inference kernel ("packed" or "aten") by row class
            and shape kind for a model of those widths (`bf16_kernels`); measured the first time a bf16 copy of a
            model of that shape is prepared.
        bf16_faster_widths: by "d_model x d_ff x vocabulary", by row class, whether a decoding step's products ran
            faster in bf16 (on the kernels of `bf16_widths`) than in float32 (on those of `inference_widths`) by
            more than their spread (`bf16_faster`); measured the first time the precision of such a model is left
            to the machine on a CPU with native bf16.
        bf16_attention: by "rows x d_model", whether bf16 training computes attention in float32 (its inputs cast up)
            because forward and backward ran faster so than in bf16 (`bf16_training_attention`); measured the first
            time a bf16 run of that shape asks.
        bf16_training: by "rows x d_model x d_ff", whether a training step ran faster under bf16 autocast than in
            float32, each as `select` prepares it (`bf16_training_faster`): what training on a CPU with native bf16
            takes where its precision is left to the machine; measured the first time such a run asks.
        int8_widths: by "d_model x d_ff x vocabulary", by row class and shape kind, the product an int8 layer
            (`int8.Int8Linear`) runs there: "int8" (fbgemm's), "int8 onednn" or "float32" (`int8_kernels`);
            measured the first time an int8 copy of a model of that shape is prepared.
        bits_dropout: whether training dropout ran faster with its masks drawn as random integers
            (`dropout.BitsDropout`) than by `F.dropout`'s `bernoulli_`, forward and backward
            (`bits_dropout_faster`); None until a CPU training run first asks.
        threads: by "<precision and shape of a model> <pass> at <n> rows", the threads a decoding step or an
            encoding of such a model over about n rows ran fastest on: all this process's (the key's thread count),
            or one, timed on the model itself (`aiayn.inference.threads`); measured the first time a search meets
            those rows on more than one thread.
        ratios: by "what: candidate", how much faster than the plain candidate it ran: [median, lower quartile]
            of the per-repeat speed ratios (a choice is kept only where the lower quartile beats `timing.MARGIN`).
    """

    inference: dict[str, dict[str, str]] | None = None
    train_onednn: bool | None = None
    fused_qkv_inference: bool | None = None
    fused_qkv_train: bool | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    machine: dict[str, str] = field(default_factory=dict)
    load: float = 0.0
    torch_layers_inference: bool | None = None
    ratios: dict[str, list[float]] = field(default_factory=dict)
    int8_weights: dict[str, dict[str, bool]] | None = None
    training: dict[str, list[bool]] | None = None
    inference_widths: dict[str, dict[str, dict[str, str]]] | None = None
    int8_widths: dict[str, dict[str, dict[str, str]]] | None = None
    inference_layers: dict[str, list[bool]] | None = None
    int8_weights_widths: dict[str, dict[str, dict[str, bool]]] | None = None
    bf16_widths: dict[str, dict[str, dict[str, str]]] | None = None
    bf16_faster_widths: dict[str, dict[str, bool]] | None = None
    bf16_attention: dict[str, bool] | None = None
    bf16_training: dict[str, bool] | None = None
    bits_dropout: bool | None = None
    threads: dict[str, int] | None = None

    def describe(self) -> str:
        """One line: the kernel of each row class, training's product and fused Q/K/V, with the measured ratios."""
        def ratio(what: str, chosen: str, plain: str) -> str:
            if f"{what}: {plain}" not in self.seconds or f"{what}: {chosen}" not in self.seconds:
                return "not timed"
            faster = self.seconds[f"{what}: {plain}"] / self.seconds[f"{what}: {chosen}"]
            return f"{faster:.2f}x" if faster > 0 else "unavailable"

        def margin(what: str, chosen: str, plain: str) -> str:
            spread = self.ratios.get(f"{what}: {chosen}")
            return (f"{spread[0]:.2f}x {plain}, at least {spread[1]:.2f}x in 3 of 4 repeats" if spread
                    else f"{ratio(what, chosen, plain)} {plain}")

        def kinds(name: str, by_kind: dict[str, str], plain: str = "dense", prefix: str = "", suffix: str = "") -> str:
            """Each shape kind's kernel, with its margin over `plain` recorded as "{prefix}{name} {kind}{suffix}"."""
            return ", ".join(f"{kind} {kernel}" + (f" ({margin(f'{prefix}{name} {kind}{suffix}', kernel, plain)})"
                                                   if kernel != plain else "") for kind, kernel in by_kind.items())

        def rows(name: str) -> str:
            """A row class as the text names it: "one row", "few rows", "many rows"."""
            return f"{name} row{'s' if name != 'one' else ''}"

        def by_rows(table: dict[str, dict[str, str]], **how: str) -> str:
            return "; ".join(f"{rows(name)}: {kinds(name, by_kind, **how)}" for name, by_kind in table.items())

        def yes(flag: bool) -> str:
            return "yes" if flag else "no"

        if self.inference is None:
            base = "a base model's shapes: not measured (nothing has asked for them)"
        else:
            train = "oneDNN" if self.train_onednn else "F.linear"
            base = (f"inference products: {by_rows(self.inference)}; training products: {train} "
                    f"({ratio('train', 'onednn', 'dense')} F.linear's speed); fused QKV: inference "
                    f"{yes(self.fused_qkv_inference)} (one row {ratio('qkv one', 'fused', 'separate')}, "
                    f"many {ratio('qkv', 'fused', 'separate')}), training "
                    f"{yes(self.fused_qkv_train)} ({ratio('qkv train', 'fused', 'separate')}); "
                    f"PyTorch's fused encoder layer: {yes(self.torch_layers_inference)} "
                    f"({ratio('encoder layer', 'torch', 'aiayn')})")
        return (base
                + "".join(f"; training {key} (rows x d_model x d_ff): {'oneDNN' if onednn else 'F.linear'} "
                          f"({ratio(f'train {key}', 'onednn', 'dense')} F.linear's speed), fused QKV "
                          f"{'yes' if fused else 'no'} ({ratio(f'qkv train {key}', 'fused', 'separate')})"
                          for key, (onednn, fused) in (self.training or {}).items())
                + "".join(f"; inference at {key} (d_model x d_ff x vocabulary): "
                          + "; ".join(f"{rows(name)}: "
                                      + ", ".join(f"{kind} {kernel}" for kind, kernel in by_kind.items())
                                      for name, by_kind in found.items())
                          for key, found in (self.inference_widths or {}).items())
                + "".join(f"; bf16 at {key}: {by_rows(found, plain='packed', prefix='bf16 ', suffix=f' {key}')}"
                          for key, found in (self.bf16_widths or {}).items())
                + "".join(f"; a step's products in bf16 at {key}: "
                          + ", ".join(f"{rows(name)} {margin(f'bf16 step {name} {key}', 'bf16', 'float32')}"
                                      + ("" if faster else " (float32 kept)") for name, faster in found.items())
                          for key, found in (self.bf16_faster_widths or {}).items())
                + "".join(f"; bf16 training at {key} (rows x d_model): attention in "
                          f"{'float32' if up else 'bf16'} ({margin(f'bf16 attention {key}', 'float32', 'bf16')})"
                          for key, up in (self.bf16_attention or {}).items())
                + "".join(f"; training at {key} (rows x d_model x d_ff): "
                          f"{'bf16' if faster else 'float32'} ({margin(f'bf16 training {key}', 'bf16', 'float32')})"
                          for key, faster in (self.bf16_training or {}).items())
                + "".join(f"; at {key}: fused QKV {yes(fused)} "
                          f"(one row {ratio(f'qkv one {key}', 'fused', 'separate')}, "
                          f"many {ratio(f'qkv {key}', 'fused', 'separate')}), PyTorch's fused encoder layer "
                          f"{yes(torch_layers)} ({ratio(f'encoder layer {key}', 'torch', 'aiayn')})"
                          for key, (fused, torch_layers) in (self.inference_layers or {}).items())
                + ("" if self.bits_dropout is None else
                   f"; training dropout: {'random bits' if self.bits_dropout else 'bernoulli'} "
                   f"({margin('dropout', 'bits', 'bernoulli')})")
                + "".join(f"; {key}: on {n} thread{'s' if n > 1 else ''} (one thread: "
                          f"{margin(f'threads {key}', 'one', 'all')})" for key, n in (self.threads or {}).items())
                + "".join(f"; int8 at {key} (\"int8\": fbgemm's): "
                          f"{by_rows(found, plain='int8', prefix='int8 ', suffix=f' {key}')}"
                          for key, found in (self.int8_widths or {}).items()))


@functools.cache
def _processor() -> tuple[str, str]:
    """(CPU model name, its vector features) from /proc/cpuinfo where there is one."""
    flags, model = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            if key.strip() == "flags":
                flags = " ".join(sorted(f for f in value.split() if f.startswith(("avx", "amx", "fma", "sse4"))))
                break
    except OSError:
        pass
    return model or platform.processor(), flags


def machine() -> dict[str, str]:
    """What the measurements depend on: CPU model and features, PyTorch, threads, ISA-limiting variables."""
    model, flags = _processor()
    return {"cpu": model, "flags": flags, "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": str(torch.get_num_threads()),
            **{name: os.environ.get(name, "") for name in ENVIRONMENT}}


# The largest cache file read, far above what this code writes: a larger file is not a cache aiayn wrote.
CACHE_LIMIT = 16 * 2**20


def cache_dir() -> Path:
    """`$AIAYN_CACHE_DIR`, else `$XDG_CACHE_HOME/aiayn`, else `~/.cache/aiayn`."""
    if os.environ.get("AIAYN_CACHE_DIR"):
        return Path(os.environ["AIAYN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiayn"


def cache_path(description: dict[str, str]) -> Path:
    """The cache file for one machine description."""
    digest = hashlib.sha256(json.dumps([FORMAT, description], sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"cpu-products-{digest}.json"


_chosen: dict[str, Choices] = {}  # this process's choices, by machine description (threads included)


def _key(description: dict[str, str]) -> str:
    """`_chosen`'s key for one machine description."""
    return json.dumps(description, sort_keys=True)


def choices(*, refresh: bool = False) -> Choices:
    """This machine's choices (for its current thread count), a base model's shapes included: from the cache, else
    measured (a few seconds) and cached. `refresh=True` (or `AIAYN_RECALIBRATE=1`, once a process) measures again
    and replaces the cached result."""
    description = machine()
    key = _key(description)
    so_far = _chosen.get(key)
    if refresh or so_far is None or so_far.inference is None:
        again = refresh or (so_far is None and bool(os.environ.get("AIAYN_RECALIBRATE")))
        _chosen[key] = _load_or_measure(refresh=again, description=description,
                                        so_far=None if refresh else so_far)
    return _chosen[key]


def _measured_so_far() -> Choices:
    """This machine's choices as far as they are measured, measuring nothing: this process's, else the cache's (with
    `AIAYN_RECALIBRATE=1`, not read once a process), else none yet. What a model's own widths need is measured into
    it (`_at_widths`, `training_choices`) without waiting for a base model's shapes."""
    description = machine()
    key = _key(description)
    if key not in _chosen:
        cached = None if os.environ.get("AIAYN_RECALIBRATE") else _cached(description)
        _chosen[key] = cached or Choices(machine=description)
    return _chosen[key]


def _cached(description: dict[str, str]) -> Choices | None:
    """The cache file's choices for `description`, unless measured by older code or on a busier machine than now, or
    the file is no cache aiayn wrote (a FIFO, a device, a link to one, larger than `CACHE_LIMIT`): read without
    ever blocking."""
    found = _on_disk(description)
    threads = int(description["threads"])
    if found is not None and not (timing.busy(found.load, threads)
                                  and timing.measured_busy(found.load, timing.other_work(), threads)):
        return found
    return None


def _on_disk(description: dict[str, str]) -> Choices | None:
    """The cache file's choices for `description` as written, however busy the machine was; None unless this code
    wrote them (see `_cached`)."""
    path = cache_path(description)
    try:
        found = Choices(**json.loads(read_regular_file(path, limit=CACHE_LIMIT)))
        if _well_formed(found) and found.machine == description and path.stat().st_mtime >= _library_time():
            return found
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


def _merged(older: Choices, newer: Choices) -> Choices:
    """`newer` with what only `older` measured kept: a table's entries by key (`newer`'s where both have one), a
    field `newer` has not measured, and the busier load."""
    values = {}
    for kept in fields(Choices):
        old, new = getattr(older, kept.name), getattr(newer, kept.name)
        values[kept.name] = {**old, **new} if isinstance(old, dict) and isinstance(new, dict) else (
            old if new is None else new)
    return replace(newer, **{**values, "machine": newer.machine, "load": max(older.load, newer.load)})


def _well_formed(found: Choices) -> bool:
    """Whether cached choices have the types this code writes (a file of the right keys edited by hand may not)."""
    tables = (found.inference, found.int8_weights, found.training, found.inference_widths, found.int8_widths,
              found.inference_layers, found.int8_weights_widths, found.bf16_widths, found.bf16_faster_widths,
              found.bf16_attention, found.bf16_training, found.threads)
    pairs = [*(found.training or {}).values(), *(found.inference_layers or {}).values()]
    counts = (found.threads or {}).values()  # thread counts, which `torch.set_num_threads` is given
    return (all(isinstance(d, dict) for d in (found.seconds, found.ratios, found.machine))
            and all(t is None or isinstance(t, dict) for t in tables) and isinstance(found.load, (int, float))
            and all(isinstance(pair, list) and len(pair) == 2 for pair in pairs)
            and all(type(n) is int and n >= 1 for n in counts))


def _load_or_measure(*, refresh: bool, description: dict[str, str] | None = None,
                     so_far: Choices | None = None) -> Choices:
    """The choices with a base model's shapes measured: the cache's where it has them, else measured now and added
    to what was measured so far (`so_far`, else the cache's; a model's widths are kept), then cached."""
    description = description or machine()
    found = so_far if so_far is not None else None if refresh else _cached(description)
    if found is not None and found.inference is not None:
        return found
    with torch.inference_mode(False), timing.competing() as competition:
        base = replace(measure(description), load=competition.cores)
    if found is not None:  # a model's widths kept; the busiest measurement decides whether it is measured again
        base = _merged(found, base)
    _store(base, merge=not refresh)
    logger.info("CPU products measured (%s): %s", cache_path(description), base.describe())
    return base


def _store(found: Choices, *, merge: bool = True) -> None:
    """Write `found` to its machine's cache file, merged with what other processes measured into it meanwhile
    (`_merged`) unless that was measured busier or `merge` is False, under a lock beside it (a read-only home only
    costs measuring again next time)."""
    path = cache_path(found.machine)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.with_name(path.name + ".lock")):
            on_disk = _on_disk(found.machine) if merge else None
            if on_disk is not None and on_disk.load <= found.load:
                found = _merged(on_disk, found)
            atomic_write_text(path, json.dumps(asdict(found), indent=1))
    except OSError as err:
        logger.info("could not cache the CPU product measurements in %s (%s)", path, err)


def _kept(found: Choices) -> Choices:
    """`found`, with a measurement added to what was cached, as this process's choices and in the cache file."""
    _chosen[_key(found.machine)] = found
    _store(found)
    return found


def _with_measured(found: Choices, field: str, key: str | None, measure: Callable[[dict, dict], object]) -> Choices:
    """`found` with what `measure(seconds, ratios)` returns (writing its timings into the two) kept under
    `Choices.<field>` (under `[key]` of it where `key` is given), and the competition it met (`timing.competing`)
    in its load where that is the busiest yet; kept for this process and in the cache (`_kept`)."""
    seconds, ratios = dict(found.seconds), dict(found.ratios)
    with torch.inference_mode(False), torch.no_grad(), timing.competing() as competition:
        measured = measure(seconds, ratios)
    value = measured if key is None else {**(getattr(found, field) or {}), key: measured}
    return _kept(replace(found, **{field: value}, seconds=seconds, ratios=ratios,
                         load=max(found.load, competition.cores)))


def _library_time() -> float:
    """When the code that measures and runs the kernels last changed (its newest file in `aiayn.backends`): choices
    cached before that were measured by other code, and are measured again (the torch version is in the key)."""
    return max(p.stat().st_mtime for p in Path(__file__).parent.glob("*.py"))


def _fused_qkv_inference(square: torch.Tensor, inference: dict[str, dict[str, str]], seconds: dict[str, float],
                         gen: torch.Generator, cold_bytes: int = COLD_BYTES, what: str = "") -> bool:
    """Whether Q, K and V run faster as one stacked (3 d, d) product than as three (d, d) ones at inference.

    Each side runs the kernels just chosen for it (the stack is a wide product, each projection a square
    one), at one row over weights read as a decoding step reads them (`_cold_copies`) and at many rows (an encoder).
    Fused wins where it is faster for one of the two and not slower for the other.
    """
    faster, slower = [], []
    for name, rows in (ROW_CLASSES[0], ROW_CLASSES[-1]):
        kernels = {kind: dict.fromkeys(inference, inference[name][kind]) for kind in ("square", "wide")}
        copies = -(-cold_bytes // (3 * square.numel() * square.element_size())) if rows <= FEW_ROWS_MAX else 1
        separate, fused = [], []
        for _ in range(copies):
            qkv = [square.clone() for _ in range(3)]
            separate.append([cpu.PackedLinear(w, None, kernels=kernels["square"]) for w in qkv])
            fused.append(cpu.PackedLinear(torch.cat(qkv), None, kernels=kernels["wide"]))
        x = torch.randn(rows, square.shape[1], generator=gen)
        timed = timing.timed({"separate": lambda layers=separate, x=x: [p(x) for three in layers for p in three],
                              "fused": lambda layers=fused, x=x: [p(x) for p in layers]},
                             warm=_warm(rows, cold_bytes))
        timing.record(seconds, ("qkv" if name == ROW_CLASSES[-1][0] else f"qkv {name}") + what, timed)
        faster.append(timing.pick(timed, "separate") == "fused")
        slower.append(timing.pick(timed, "fused") == "separate")
        del separate, fused
    return any(faster) and not any(slower)


def _int8_weights(weights: dict[str, tuple[torch.Tensor, torch.Tensor]], inference: dict[str, dict[str, str]],
                  seconds: dict[str, float], ratios: dict[str, list[float]], gen: torch.Generator,
                  cold_bytes: int = COLD_BYTES, what: str = "") -> dict[str, dict[str, bool]]:
    """Whether a product over int8 weights (read as bytes, scaled inside the product) beats the float32 kernel
    chosen in `inference`, by row class (one, few: decoding) and shape kind, over enough copies of each weight to
    hold `cold_bytes` (read as a step reads them: `_cold_copies`), recorded as "int8 weights {row class}
    {kind}{what}"."""
    if not int8.int8_weights_usable():
        return {}
    faster: dict[str, dict[str, bool]] = {name: {} for name, _ in ROW_CLASSES[:2]}
    for kind, (w, b) in weights.items():
        copies = [w if c == 0 else w.clone() for c in range(_cold_copies(w, cold_bytes))]
        quantized = [int8.int8_weights(v) for v in copies]  # once per kind, for both row classes
        for name, rows in ROW_CLASSES[:2]:
            x = torch.randn(rows, w.shape[1], generator=gen)
            fp32 = [_on_kernel(v, b, inference[name][kind]) for v in copies]
            timed = timing.timed({"float32": lambda layers=fp32, x=x: [f(x) for f in layers],
                                  "int8 weights": lambda qs=quantized, x=x, b=b: [int8.int8_weights_product(x, q, s, b)
                                                                                   for q, s in qs]},
                                 warm=_warm(rows, cold_bytes))
            timing.record(seconds, f"int8 weights {name} {kind}{what}", timed, plain="float32", ratios=ratios)
            faster[name][kind] = timing.pick(timed, "float32") == "int8 weights"
            del fp32
        del copies, quantized
    return faster


def _torch_layers_inference(inference: dict[str, dict[str, str]], fused_qkv: bool, seconds: dict[str, float],
                            widths: tuple[int, int] | None = None, what: str = "") -> bool:
    """Whether PyTorch's fused encoder layer runs an encoder layer (a base model's, or of `widths` (d_model, d_ff))
    on many rows (2 x 128 tokens) faster than the layer written out on the kernels just chosen (and fused Q/K/V
    where chosen)."""
    config = preset("base").replace(dropout=0.0, n_encoder_layers=1)
    if widths is not None:  # heads of at least 32 wide, up to a base model's 8
        d_model, d_ff = widths
        heads = next(h for h in (8, 4, 2, 1) if d_model % h == 0 and (d_model // h >= 32 or h == 1))
        config = config.replace(d_model=d_model, d_ff=d_ff, n_heads=heads)
    layer = build_encoder(config).layers[0].eval()
    if not TorchEncoderLayer.runs(layer):
        seconds.update({f"encoder layer{what}: aiayn": 1.0, f"encoder layer{what}: torch": float("inf")})
        return False
    written_out, fused = _written_out(layer, cpu.kernel_triples(inference), fused_qkv), TorchEncoderLayer(layer)
    x = torch.randn(2, 128, layer.self_attn.d_model, generator=torch.Generator().manual_seed(1))
    timed = timing.timed({"aiayn": lambda: written_out(x), "torch": lambda: fused(x)}, LAYER_REPEATS)
    timing.record(seconds, f"encoder layer{what}", timed)
    ratio = statistics.median(t / p for t, p in zip(timed["torch"], timed["aiayn"]))
    return ratio < 1 - LAYER_MARGIN


def _written_out(layer: nn.Module, kernels: tuple[tuple[str, str, str], ...], fused_qkv: bool) -> nn.Module:
    """A copy of the encoder `layer` whose products run `kernels` (`cpu.kernel_triples`), Q, K and V one stacked
    product where `fused_qkv`, the activation inside the first FFN product: the layer as inference runs it on
    these kernels where PyTorch's fused layer does not."""
    def packed(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return cpu.PackedLinear.on_kernels(weight, bias, kernels)

    written_out = copy.deepcopy(layer)
    if fused_qkv:
        written_out = fuse_qkv(written_out, product=F.linear, frozen=packed)
    cpu.use_onednn(written_out, prepack=packed, skip=stacked_away(written_out))
    return cpu.fuse_activations(written_out)


def _training(rows: int, d_model: int, d_ff: int, seconds: dict[str, float], ratios: dict[str, list[float]],
              gen: torch.Generator, what: str = "") -> tuple[bool, bool]:
    """(products on oneDNN, Q/K/V stacked) for training layers of these widths on `rows` rows: each measured
    forward and backward against F.linear and three separate products, recorded as "train{what}" and
    "qkv train{what}"."""
    with torch.enable_grad():
        # a layer's products (the vocabulary projection is one product among a step's many)
        shapes = ((d_model, d_ff), (d_model, d_model), (d_ff, d_model))
        params = [((torch.randn(n_out, n_in, generator=gen) / n_in**0.5).requires_grad_(),
                   torch.randn(n_out, generator=gen).requires_grad_()) for n_in, n_out in shapes]
        xs = [torch.randn(rows, n_in, generator=gen, requires_grad=True) for n_in, _ in shapes]

        def train_step(product: Callable) -> Callable[[], None]:
            return lambda: torch.autograd.backward([product(x, w, b).sum() for x, (w, b) in zip(xs, params)])

        candidates = {"dense": train_step(F.linear)}
        if cpu.onednn_usable():
            candidates["onednn"] = train_step(cpu.onednn_linear)
        timed = timing.timed(candidates)
        timing.record(seconds, f"train{what}", timed, plain="dense", ratios=ratios)
        seconds.setdefault(f"train{what}: onednn", float("inf"))
        onednn = timing.pick(timed, "dense") == "onednn"
        wq, wk, wv = (params[1][0].detach().clone().requires_grad_() for _ in range(3))
        xq = xs[1]
        timed = timing.timed({
            "separate": lambda: torch.autograd.backward([sum(F.linear(xq, w).sum() for w in (wq, wk, wv))]),
            "fused": lambda: torch.autograd.backward([F.linear(xq, torch.cat([wq, wk, wv])).sum()]),
        })
        timing.record(seconds, f"qkv train{what}", timed, plain="separate", ratios=ratios)
        return onednn, timing.pick(timed, "separate") == "fused"


def training_choices(rows: int, d_model: int, d_ff: int) -> tuple[bool, bool]:
    """(products on oneDNN, Q/K/V stacked) for training a model of these widths on batches of about `rows`
    tokens (timed on at most `TRAIN_SHAPE_ROWS`): measured the first time a run of that shape asks (under a
    second at a short recipe's widths), then kept with the other choices in the cache (`Choices.training`).
    A base model's widths (`train_onednn`, `fused_qkv_train`) do not decide for a narrow one: oneDNN's
    products that win at d_model 512 can lose at d_model 128 (docs/notes.md, "training on the recipe's
    shapes")."""
    found = _measured_so_far()
    rows = min(rows, TRAIN_SHAPE_ROWS)
    key = f"{rows}x{d_model}x{d_ff}"
    if key not in (found.training or {}):  # `_training` turns gradients on for itself
        found = _with_measured(found, "training", key, lambda seconds, ratios: list(_training(
            rows, d_model, d_ff, seconds, ratios, torch.Generator().manual_seed(2), f" {key}")))
    onednn, fused = found.training[key]  # a list in the cache's JSON
    return onednn, fused


# The length of the sequences the bf16 training measurements cut their batch into: a typical sentence's, in tokens.
ATTENTION_LENGTH = 32


def _heads(d_model: int) -> int:
    """The heads the bf16 training measurements give a model `d_model` wide: of 64 (the paper's d_k), or one of
    d_model where narrower."""
    return max(1, d_model // 64)


def _bf16_attention(rows: int, d_model: int, seconds: dict[str, float], ratios: dict[str, list[float]],
                    gen: torch.Generator, what: str) -> bool:
    """Whether causal self-attention over `rows` tokens (sequences of `ATTENTION_LENGTH`, `_heads`) ran forward and
    backward faster in float32, its bf16 inputs cast up and its output down, than in bf16 (recorded as
    "bf16 attention{what}")."""
    heads = _heads(d_model)
    shape = (max(1, rows // ATTENTION_LENGTH), heads, ATTENTION_LENGTH, d_model // heads)
    with torch.enable_grad():
        q, k, v = (torch.randn(shape, generator=gen).bfloat16().requires_grad_() for _ in range(3))
        grad = torch.randn(shape, generator=gen).bfloat16()

        def bf16() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        def float32() -> None:
            F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16().backward(grad)

        timed = timing.timed({"bf16": bf16, "float32": float32})
    timing.record(seconds, f"bf16 attention{what}", timed, plain="bf16", ratios=ratios)
    return timing.pick(timed, "bf16") == "float32"


def bf16_training_attention(rows: int, d_model: int) -> bool:
    """Whether bf16 training of a model `d_model` wide on batches of about `rows` tokens (timed on at most
    `TRAIN_SHAPE_ROWS`) computes attention in float32: where `scaled_dot_product_attention`'s bf16 backward is the
    slower (on an AVX-512 AMD EPYC, 1.7-5x float32's: docs/notes.md, "Training"). Measured the first time a run of
    that shape asks (well under a second), then kept in the cache (`Choices.bf16_attention`)."""
    found = _measured_so_far()
    rows = min(rows, TRAIN_SHAPE_ROWS)
    key = f"{rows}x{d_model}"
    if key not in (found.bf16_attention or {}):
        found = _with_measured(found, "bf16_attention", key, lambda seconds, ratios: _bf16_attention(
            rows, d_model, seconds, ratios, torch.Generator().manual_seed(7), f" {key}"))
    return bool(found.bf16_attention[key])


# Training dropout is timed on this many elements (a 4,096-token batch of a 256-wide model), at dropout 0.1.
DROPOUT_ELEMENTS = 4096 * 256
DROPOUT_P = 0.1


def _dropouts(seconds: dict[str, float], ratios: dict[str, list[float]], gen: torch.Generator) -> bool:
    """Whether dropout forward and backward ran faster with `dropout.bits_dropout`'s masks than `F.dropout`'s
    (recorded as "dropout")."""
    with torch.enable_grad():
        x = torch.randn(DROPOUT_ELEMENTS, generator=gen).requires_grad_()
        grad = torch.randn(DROPOUT_ELEMENTS, generator=gen)
        timed = timing.timed({"bernoulli": lambda: F.dropout(x, DROPOUT_P, training=True).backward(grad),
                              "bits": lambda: dropout.bits_dropout(x, DROPOUT_P).backward(grad)})
    timing.record(seconds, "dropout", timed, plain="bernoulli", ratios=ratios)
    return timing.pick(timed, "bernoulli") == "bits"


def dropout_setting() -> str:
    """`AIAYN_DROPOUT`: "bits" or "bernoulli" where set, "" where the machine's measurement decides; any other value
    is refused in one line."""
    forced = os.environ.get("AIAYN_DROPOUT", "")
    if forced not in ("", "bits", "bernoulli"):
        raise ValueError(f"AIAYN_DROPOUT must be bits or bernoulli (or unset: measured), got {forced!r}")
    return forced


def bits_dropout_faster() -> bool:
    """Whether CPU training draws its dropout masks as random integers (`dropout.BitsDropout`): where forward and
    backward ran faster so than `F.dropout`'s `bernoulli_` (1.9x slower on an AMD EPYC, where PyTorch does not give
    it to MKL). Measured the first time a CPU training run asks (under a second), then kept in the cache
    (`Choices.bits_dropout`). `AIAYN_DROPOUT=bernoulli` (or `bits`) decides without measuring: `F.dropout`'s own
    masks, for runs that must draw as PyTorch draws."""
    forced = dropout_setting()
    if forced:
        return forced == "bits"
    found = _measured_so_far()
    if found.bits_dropout is None:
        found = _with_measured(found, "bits_dropout", None, lambda seconds, ratios: _dropouts(
            seconds, ratios, torch.Generator().manual_seed(9)))
    return bool(found.bits_dropout)


# The pieces of the one-layer model `bf16_training_faster` times (the recipe's vocabulary: its output projection a
# step's largest product, as in a real run's).
TRAINING_VOCABULARY = 4000


def _training_steps(rows: int, d_model: int, d_ff: int, prepare: Callable[[str, nn.Module], tuple],
                    gen: torch.Generator) -> dict[str, Callable[[], None]]:
    """A training step (forward, cross-entropy, backward; no optimizer) of a one-layer encoder-decoder of these widths
    over `rows` tokens (source and target sequences of `ATTENTION_LENGTH`), in float32 and in bf16: each run on the copy
    `prepare(precision, model)` gives with its autocast, (prepared module, context factory)."""
    cfg = ModelConfig(vocab_size=TRAINING_VOCABULARY, d_model=d_model, n_heads=_heads(d_model), d_ff=d_ff,
                      n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, max_len=ATTENTION_LENGTH)
    model = build_model(cfg).train()
    shape = (max(1, rows // (2 * ATTENTION_LENGTH)), ATTENTION_LENGTH)
    src, tgt = (torch.randint(4, cfg.vocab_size, shape, generator=gen) for _ in range(2))

    def step(precision: str) -> Callable[[], None]:
        module, autocast = prepare(precision, model)

        def run() -> None:
            model.zero_grad(set_to_none=True)
            with torch.enable_grad():  # timed under `_with_measured`'s no_grad
                with autocast():
                    logits = module(src, tgt)
                F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten()).backward()

        return run

    return {"float32": step("fp32"), "bf16": step("bf16")}


def bf16_training_faster(rows: int, d_model: int, d_ff: int, prepare: Callable[[str, nn.Module], tuple]) -> bool:
    """Whether training a model of these widths on batches of about `rows` tokens (timed on at most
    `TRAIN_SHAPE_ROWS`) runs faster under bf16 autocast than in float32 by more than its spread (`timing.pick`), a
    one-layer model's step timed in both as `prepare(precision, model)` prepares it (`_training_steps`). Measured the
    first time a run of that shape asks (a second or two), then kept in the cache (`Choices.bf16_training`)."""
    rows = min(rows, TRAIN_SHAPE_ROWS)
    key = f"{rows}x{d_model}x{d_ff}"
    found = _measured_so_far()
    if key not in (found.bf16_training or {}):
        # prepared first: preparing measures what each precision's backend chooses, and keeps that in the cache
        steps = _training_steps(rows, d_model, d_ff, prepare, torch.Generator().manual_seed(8))

        def measure(seconds: dict[str, float], ratios: dict[str, list[float]]) -> bool:
            timed = timing.timed(steps)
            timing.record(seconds, f"bf16 training {key}", timed, plain="float32", ratios=ratios)
            return timing.pick(timed, "float32") == "bf16"

        found = _with_measured(_measured_so_far(), "bf16_training", key, measure)
    return bool(found.bf16_training[key])


def _on_kernel(weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> cpu.PackedLinear:
    """A layer over `weight` (float32 or bf16) running `kernel` (`cpu.KERNELS`) at every row class, to be timed."""
    return cpu.PackedLinear(weight, bias, kernels=dict.fromkeys((name for name, _ in ROW_CLASSES), kernel))


def _cold_copies(weight: torch.Tensor, cold_bytes: int) -> int:
    """How many copies of `weight` hold `cold_bytes` (at least one): one- and few-row products are timed cycling
    through them (`timing.timed` with `warm`), so that each is read from where a decoding step finds a model's weights
    of that many bytes: from memory where they exceed the processor's cache, not from the cache a repeat of one
    product left it in; from the cache where they fit."""
    return max(1, -(-cold_bytes // (weight.numel() * weight.element_size())))


def _warm(rows: int, cold_bytes: int) -> bool:
    """Whether products of `rows` rows over copies holding `cold_bytes` are timed each pass right after its own
    (`timing.timed`): one and few rows over a model's bytes that may fit in the processor's cache, which its steps
    then find there. Over `COLD_BYTES` every pass streams from memory, right after its own or not."""
    return rows <= FEW_ROWS_MAX and cold_bytes < COLD_BYTES


def _shape_weights(gen: torch.Generator, kinds=SHAPE_KINDS) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A weight (out, in) and bias (out,) of each shape kind, (kind, (in, out)) pairs: a base model's by default, as
    `measure` times them."""
    return {kind: (torch.randn(n_out, n_in, generator=gen) / n_in**0.5, torch.randn(n_out, generator=gen))
            for kind, (n_in, n_out) in kinds}


def _width_weights(gen: torch.Generator, d_model: int, d_ff: int,
                   vocab: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A weight and bias of each shape kind at a model's own widths (as `_shape_weights` at a base model's); no
    vocabulary projection where `vocab` is 0 (a model without one: its layers of that kind keep
    `cpu.DEFAULT_KERNELS`, and there are none)."""
    kinds = (("wide", (d_model, d_ff)), ("square", (d_model, d_model)), ("narrow", (d_ff, d_model)))
    return _shape_weights(gen, kinds + ((("vocabulary", (d_model, vocab)),) if vocab else ()))


def int8_weight_choices(*shape: int) -> dict[str, dict[str, bool]]:
    """`Choices.int8_weights` of this machine: measured the first time int8 inference asks (about a second), then
    kept with the other choices in the cache. With the `shape` (d_model, d_ff, vocabulary, weight bytes) of a model
    other than a base-wide one: measured on that model's widths against its kernels (`inference_kernels`), the
    first time an int8 copy of such a model is prepared, and kept in `Choices.int8_weights_widths`."""
    if shape and tuple(shape[:2]) != dict(SHAPE_KINDS)["wide"]:
        kernels = inference_kernels(*shape)
        d_model, d_ff, vocab, weight_bytes = shape

        def measure_at_widths(weights, cold_bytes, seconds, ratios, gen, what) -> dict[str, dict[str, bool]]:
            return _int8_weights(weights, kernels, seconds, ratios, gen, cold_bytes, what)

        return _at_widths("int8_weights_widths", (d_model, d_ff, vocab), weight_bytes, 6, measure_at_widths)
    found = choices()
    if found.int8_weights is None:
        gen = torch.Generator().manual_seed(1)
        found = _with_measured(found, "int8_weights", None, lambda seconds, ratios: _int8_weights(
            _shape_weights(gen), found.inference, seconds, ratios, gen))
    return found.int8_weights


def _inference_kernels(weights: dict[str, tuple[torch.Tensor, torch.Tensor]], cold_bytes: int,
                       seconds: dict[str, float], ratios: dict[str, list[float]], gen: torch.Generator,
                       what: str = "") -> dict[str, dict[str, str]]:
    """The kernel of each row class and shape kind, timed on `weights` (by shape kind); one- and few-row products
    over enough copies of each weight to hold `cold_bytes`, recorded as "{row class} {kind}{what}"."""
    usable = cpu.onednn_usable()
    inference: dict[str, dict[str, str]] = {}
    for name, rows in ROW_CLASSES:
        inference[name] = {}
        for kind, (w, b) in weights.items():
            copies = _cold_copies(w, cold_bytes) if rows <= FEW_ROWS_MAX else 1
            shaped = [(w if c == 0 else w.clone(), b) for c in range(copies)]
            xs = [torch.randn(rows_measured(name, kind), w.shape[1], generator=gen) for w, _ in shaped]
            layers = {"dense": [lambda x, w=w, b=b: F.linear(x, w, b) for w, b in shaped]}
            if usable:
                layers["packed"] = [_on_kernel(w, b, "packed") for w, b in shaped]
            if name == "one":
                columns = [(w.t().contiguous(), b) for w, b in shaped]  # (in, out)
                layers["columns"] = [lambda x, c=c, b=b: torch.addmm(b, x, c) for c, b in columns]
            timed = timing.timed({k: (lambda fs=fs, xs=xs: [f(x) for f, x in zip(fs, xs)])
                                  for k, fs in layers.items()}, warm=_warm(rows, cold_bytes))
            timing.record(seconds, f"{name} {kind}{what}", timed, plain="dense", ratios=ratios)
            inference[name][kind] = timing.pick(timed, "dense")
            del layers, shaped
    return inference


def inference_kernels(d_model: int, d_ff: int, vocab: int, weight_bytes: int) -> dict[str, dict[str, str]]:
    """The inference kernels (as `Choices.inference`) for a model of these widths whose weights hold `weight_bytes`:
    a base model's widths keep the machine's; others are measured the first time a model of those widths is
    prepared (about a second at a short recipe's widths), on its own shapes, the one- and few-row products over
    as many bytes as the model's weights (capped at `COLD_BYTES`), then kept in the cache
    (`Choices.inference_widths`, the first model of those widths deciding). A base model's widths do not decide
    for a narrow one: oneDNN's prepacked product, which streams a 512-wide weight from memory fastest, pays a
    fixed cost per call that is most of a 128-wide product (docs/notes.md, "Decoding")."""
    if (d_model, d_ff) == dict(SHAPE_KINDS)["wide"]:
        return choices().inference
    return _at_widths("inference_widths", (d_model, d_ff, vocab), weight_bytes, 3, _inference_kernels)


def _at_widths(field: str, widths: tuple[int, int, int], weight_bytes: int, seed: int, measure: Callable) -> dict:
    """`measure(weights, cold bytes, seconds, ratios, gen, what)` on the shapes of a model of `widths` (d_model, d_ff,
    vocabulary), the first time they are asked for; then what the cache keeps under `Choices.<field>`. A base
    model's shapes are not measured for it."""
    found = _measured_so_far()
    key = "x".join(map(str, widths))
    if key not in (getattr(found, field) or {}):
        gen = torch.Generator().manual_seed(seed)
        found = _with_measured(found, field, key, lambda seconds, ratios: measure(
            _width_weights(gen, *widths), min(weight_bytes, COLD_BYTES), seconds, ratios, gen, f" {key}"))
    return getattr(found, field)[key]


def measured_once(field: str, key: str, measure: Callable[[dict, dict], object]) -> object:
    """What the cache keeps under `Choices.<field>[key]`, measured by `measure(seconds, ratios)` (which writes its
    timings into the two) the first time it is asked for on this machine and thread count, then kept; for what is
    measured on a model itself, not on a shape's random weights (`aiayn.inference.threads`)."""
    found = _measured_so_far()
    if key not in (getattr(found, field) or {}):
        found = _with_measured(found, field, key, measure)
    return getattr(found, field)[key]


def inference_layers(d_model: int, d_ff: int, vocab: int, weight_bytes: int) -> tuple[bool, bool]:
    """(Q/K/V as one stacked product, PyTorch's fused encoder layer) for inference on a model of these widths whose
    weights hold `weight_bytes`: a base model's widths keep the machine's (`Choices.fused_qkv_inference`,
    `Choices.torch_layers_inference`); others are measured as those are, on the model's own widths and its kernels
    (`inference_kernels`), the first time a model of those widths is prepared, then kept in the cache
    (`Choices.inference_layers`)."""
    if (d_model, d_ff) == dict(SHAPE_KINDS)["wide"]:
        found = choices()
        return found.fused_qkv_inference, found.torch_layers_inference
    kernels = inference_kernels(d_model, d_ff, vocab, weight_bytes)

    def measure_layers(weights, cold_bytes, seconds, ratios, gen, what) -> list[bool]:
        fused = _fused_qkv_inference(weights["square"][0], kernels, seconds, gen, cold_bytes, what)
        return [fused, _torch_layers_inference(kernels, fused, seconds, (d_model, d_ff), what)]

    fused, torch_layers = _at_widths("inference_layers", (d_model, d_ff, vocab), weight_bytes, 5, measure_layers)
    return fused, torch_layers


# The row classes whose bf16 products are timed both ways; many rows stay on oneDNN, where a product is bound by its
# arithmetic, which PyTorch's own bf16 kernels do not run on the CPU's bf16 instructions.
BF16_TIMED_ROWS = ("one", "few")


def _bf16_kernels(weights: dict[str, tuple[torch.Tensor, torch.Tensor]], cold_bytes: int,
                  seconds: dict[str, float], ratios: dict[str, list[float]], gen: torch.Generator,
                  what: str) -> dict[str, dict[str, str]]:
    """The bf16 kernel of each row class and shape kind: oneDNN over the weight prepacked in bf16 ("packed"), or
    PyTorch's own product ("aten") where that is faster in three repeats of four (`timing.pick`). Timed as
    `_inference_kernels` times float32's: over as many copies of each weight as hold `cold_bytes` in float32 (a
    model's bytes), half of them in bf16, as the model's own weights. "aten" turns PyTorch's process-wide oneDNN
    switch off for its calls, so it is timed only where no other Python thread is alive to be computing meanwhile
    (`cpu.only_thread`); elsewhere "packed" is kept untimed."""
    kernels: dict[str, dict[str, str]] = {name: {} for name, _ in ROW_CLASSES}
    alone = cpu.only_thread()
    for name, rows in ROW_CLASSES:
        for kind, (w, b) in weights.items():
            if name not in BF16_TIMED_ROWS or not alone:
                kernels[name][kind] = "packed"
                continue
            copies = _cold_copies(w, cold_bytes)  # as many as in float32: a bf16 model holds half the bytes
            w, b = w.bfloat16(), b.bfloat16()
            shaped = [w if c == 0 else w.clone() for c in range(copies)]
            x = torch.randn(rows, w.shape[1], generator=gen).bfloat16()
            layers = {"packed": [_on_kernel(v, b, "packed") for v in shaped],  # "aten" as itself, the switch off
                      "aten": [functools.partial(cpu.aten_linear, weight=v, bias=b) for v in shaped]}
            timed = timing.timed({k: (lambda fs=fs, x=x: [f(x) for f in fs]) for k, fs in layers.items()},
                                 warm=_warm(rows, cold_bytes))
            timing.record(seconds, f"bf16 {name} {kind}{what}", timed, plain="packed", ratios=ratios)
            # Neither is PyTorch's default for a bf16 product (oneDNN over the unpacked weight, slower than both), so
            # no margin is kept for one of them: the faster in three repeats of four is taken.
            kernels[name][kind] = timing.pick(timed, "packed", margin=0.0)
            del layers, shaped
    return kernels


def bf16_kernels(d_model: int, d_ff: int, vocab: int, weight_bytes: int) -> dict[str, dict[str, str]]:
    """The bf16 inference kernel by row class and shape kind (as `Choices.inference` for float32) for a model of
    these widths whose weights hold `weight_bytes`, on a CPU with native bf16: measured the first time a bf16 copy of
    a model of those widths is prepared (about a second), then kept in the cache (`Choices.bf16_widths`). At one row
    PyTorch's own bf16 matrix-vector product streams a weight from memory faster than oneDNN's on some CPUs, and not
    on others (docs/notes.md, "Decoding")."""
    return _at_widths("bf16_widths", (d_model, d_ff, vocab), weight_bytes, 7, _bf16_kernels)


# A decoding step's products by shape kind, as `bf16_faster` times them: a decoder layer's square ones (self-attention's
# query, key and value, and the output projections), its feed-forward network's two, and the vocabulary's.
STEP_PRODUCTS = {"square": 4, "wide": 1, "narrow": 1, "vocabulary": 1}


def _bf16_step(weights: dict[str, tuple[torch.Tensor, torch.Tensor]], float32: dict[str, dict[str, str]],
               bf16: dict[str, dict[str, str]], cold_bytes: int, seconds: dict[str, float],
               ratios: dict[str, list[float]], gen: torch.Generator, what: str) -> dict[str, bool]:
    """By row class, whether `STEP_PRODUCTS` ran faster in bf16 on the kernels `bf16` chose than in float32 on those
    `float32` chose, by more than their spread (`timing.pick`): one and few rows over enough copies of each weight to
    hold `cold_bytes`, as a step reads them from memory. On more than one thread, one and few rows are timed on all
    and on one, and each precision counts the faster in each repeat: a step of those rows runs on one thread where
    that was measured faster (`aiayn.inference.threads`), and there a bf16 product that wakes the other thread on
    every call (0.37x float32 at one row of d_model 128, on two threads with passive waits) is not what runs."""
    faster: dict[str, bool] = {}
    threads = torch.get_num_threads()
    for name, rows in ROW_CLASSES:
        calls = {"float32": _step_products(weights, float32[name], rows, torch.float32, cold_bytes, gen),
                 "bf16": _step_products(weights, bf16[name], rows, torch.bfloat16, cold_bytes, gen)}
        counts = (threads, 1) if threads > 1 and rows <= FEW_ROWS_MAX else (threads,)
        timed = timing.timed({f"{precision} on {n}": lambda run=run, n=n: _on_count(n, run)
                              for precision, run in calls.items() for n in counts}, warm=_warm(rows, cold_bytes))
        best = {precision: [min(t) for t in zip(*(timed[f"{precision} on {n}"] for n in counts))]
                for precision in calls}  # each repeat, each precision on its faster count
        timing.record(seconds, f"bf16 step {name}{what}", best, plain="float32", ratios=ratios)
        faster[name] = timing.pick(best, "float32") == "bf16"
        del calls
    return faster


def _on_count(threads: int, calls: list[tuple[Callable, torch.Tensor]]) -> None:
    """Each (layer, input) call of `calls` on `threads` threads (`timing.running_on`)."""
    with timing.running_on(threads):
        for f, x in calls:
            f(x)


def _step_products(weights: dict[str, tuple[torch.Tensor, torch.Tensor]], kernels: dict[str, str], rows: int,
                   dtype: torch.dtype, cold_bytes: int, gen: torch.Generator) -> list[tuple[Callable, torch.Tensor]]:
    """A decoding step's products (`STEP_PRODUCTS` of each shape kind) as (layer, input) calls of `rows` rows in
    `dtype` on `kernels` (by shape kind): at one and few rows over as many copies of each weight as hold `cold_bytes`
    in float32 (a model's bytes; in bf16 the same copies hold half as many, as a bf16 model's own weights do)."""
    calls = []
    for kind, (w, b) in weights.items():
        copies = max(STEP_PRODUCTS[kind], _cold_copies(w, cold_bytes) if rows <= FEW_ROWS_MAX else 1)
        w, b = w.to(dtype), b.to(dtype)
        x = torch.randn(rows, w.shape[1], generator=gen).to(dtype)
        calls += [(_on_kernel(w if c == 0 else w.clone(), b, kernels[kind]), x) for c in range(copies)]
    return calls


def bf16_faster(d_model: int, d_ff: int, vocab: int, weight_bytes: int) -> dict[str, bool]:
    """By row class ("one", "few", "many"), whether a decoding step's products (`STEP_PRODUCTS`) of a model of these
    widths run faster in bf16 than in float32 on this CPU, each precision on the kernels chosen for it
    (`bf16_kernels`, `inference_kernels`): measured the first time such a model's precision is left to the machine
    on a CPU with native bf16 (a second or two), then kept in the cache (`Choices.bf16_faster_widths`)."""
    float32 = inference_kernels(d_model, d_ff, vocab, weight_bytes)
    bf16 = bf16_kernels(d_model, d_ff, vocab, weight_bytes)
    return _at_widths("bf16_faster_widths", (d_model, d_ff, vocab), weight_bytes, 8,
                      lambda weights, *rest: _bf16_step(weights, float32, bf16, *rest))


def _int8_products(weights: dict[str, tuple[torch.Tensor, torch.Tensor]], inference: dict[str, dict[str, str]],
                   cold_bytes: int, seconds: dict[str, float], ratios: dict[str, list[float]], gen: torch.Generator,
                   what: str) -> dict[str, dict[str, str]]:
    """The product an int8 layer runs, by row class and shape kind: fbgemm's ("int8"), oneDNN's over the same int8
    values ("int8 onednn", where usable: AMX's tiles where the CPU has them), or the float32 kernel chosen in
    `inference` ("float32"); another replaces fbgemm's only where clearly faster (`timing.pick`). One- and few-row
    products over enough copies of each weight to hold `cold_bytes`."""
    reduce_range = int8.int8_range() == "reduced"
    onednn = int8.onednn_int8_usable()
    kernels: dict[str, dict[str, str]] = {name: {} for name, _ in ROW_CLASSES}
    for kind, (w, b) in weights.items():
        shaped = [w if c == 0 else w.clone() for c in range(_cold_copies(w, cold_bytes))]
        quantized = [int8.Int8Linear(v, b, reduce_range=reduce_range) for v in shaped]  # for every row class
        if onednn:
            quantized = [layer.on_onednn(frozenset({name for name, _ in ROW_CLASSES})) for layer in quantized]
        for name, rows in ROW_CLASSES:
            copies = len(shaped) if rows <= FEW_ROWS_MAX else 1
            float32 = [_on_kernel(v, b, inference[name][kind]) for v in shaped[:copies]]
            x = torch.randn(rows_measured(name, kind), w.shape[1], generator=gen)
            candidates = {"int8": lambda layers=quantized[:copies], x=x: [f.int8_product(x) for f in layers],
                          "float32": lambda layers=float32, x=x: [f(x) for f in layers]}
            if onednn:
                candidates["int8 onednn"] = lambda layers=quantized[:copies], x=x: [f.onednn_product(x) for f in layers]
            timed = timing.timed(candidates, warm=_warm(rows, cold_bytes))
            timing.record(seconds, f"int8 {name} {kind}{what}", timed, plain="int8", ratios=ratios)
            kernels[name][kind] = timing.pick(timed, "int8")
            del float32
        del shaped, quantized
    return kernels


def int8_kernels(d_model: int, d_ff: int, vocab: int, weight_bytes: int) -> dict[str, dict[str, str]]:
    """By row class and shape kind, the product an int8 copy of a model of these widths runs there (`_int8_products`:
    "int8", "int8 onednn" or "float32", the last the kernels of `inference_kernels`): fbgemm's int8 product
    quantises its input on every call, a fixed cost that at few rows of a narrow model is more than the float32
    product itself, and stops at AVX-512 VNNI where oneDNN's runs on AMX (docs/notes.md, "Decoding"). Measured the
    first time an int8 copy of such a model is prepared, on its own shapes as `inference_kernels` measures them,
    then kept in the cache (`Choices.int8_widths`)."""
    inference = inference_kernels(d_model, d_ff, vocab, weight_bytes)
    return _at_widths("int8_widths", (d_model, d_ff, vocab), weight_bytes, 4,
                      lambda weights, *rest: _int8_products(weights, inference, *rest))


def measure(description: dict[str, str] | None = None) -> Choices:
    """Time every candidate kernel on this machine now (no cache)."""
    gen = torch.Generator().manual_seed(0)
    weights = _shape_weights(gen)
    seconds: dict[str, float] = {}
    ratios: dict[str, list[float]] = {}
    with torch.no_grad():
        inference = _inference_kernels(weights, COLD_BYTES, seconds, ratios, gen)
        fused_inference = _fused_qkv_inference(weights["square"][0], inference, seconds, gen)
        torch_layers = _torch_layers_inference(inference, fused_inference, seconds)
    d_model, d_ff = dict(SHAPE_KINDS)["wide"]
    train_onednn, fused_train = _training(TRAIN_ROWS, d_model, d_ff, seconds, ratios, gen)
    return Choices(inference=inference, train_onednn=train_onednn, fused_qkv_inference=fused_inference,
                   fused_qkv_train=fused_train, seconds=seconds, machine=description or machine(),
                   torch_layers_inference=torch_layers, ratios=ratios)
