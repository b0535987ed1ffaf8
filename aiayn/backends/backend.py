"""`select` decides how a model runs on a device and in a mode; `Backend.prepare` applies it, once.

    backend = select("cpu", "inference")     # what this machine can use, checked once
    prepared = backend.prepare(model)        # a copy of the model's modules sharing its parameters
    with torch.no_grad(), backend.autocast():
        logits = prepared(src, tgt)

The tricks, by device (each is off with `plain=True`, which runs the modules of `aiayn.nn` as written):
- CPU: each float32 product on the kernel measured fastest on this machine (`calibrate`: oneDNN with
  prepacked weights, MKL over transposed weights, or PyTorch's default; per number of rows and shape
  kind for inference, forward and backward for training), among those that agree with `F.linear`
  (`cpu.onednn_usable`); on request, int8 inference chosen layer by layer by its measured error (`int8`).
- CUDA: bf16 mixed precision by default where the GPU has it, which lets PyTorch's
  `scaled_dot_product_attention` take its flash kernel; decoding steps replayed from CUDA graphs;
  `torch.compile` on request.
- Every device: self-attention's Q, K and V (and cross-attention's K and V) as one product (`fused`),
  on CPU where measured faster.
The optimiser's fused kernel (`torch.optim.Adam(fused=True)`) is chosen by `aiayn.training.optim`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import Counter
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends import calibrate, cpu, int8
from aiayn.backends.absorbed import absorb_cross_attention
from aiayn.backends.devices import bf16_supported, resolve_device
from aiayn.backends.dropout import use_bits_dropout
from aiayn.backends.fused import StackedLinear, fuse_qkv, stacked_away, use_torch_encoder_layers
from aiayn.backends.shapes import SHAPE_KINDS
from aiayn.nn.attention import MultiHeadAttention

logger = logging.getLogger(__name__)

MODES = ("train", "inference")
PRECISIONS = ("fp32", "bf16", "int8")


@dataclass(frozen=True)
class Backend:
    """How a model runs: the device, the mode, the precision and the tricks `select` found usable.

    Attributes:
        device: where the model runs.
        mode: "train" (autograd, dropout) or "inference" (no gradients).
        precision: "fp32"; "bf16" (training: autocast over float32 weights; inference: a bfloat16
            copy of the weights); "int8" (inference on CPU: linear layers with int8 weights and
            activations quantised per call, where the error measured on calibration inputs allows).
        onednn: linear layers on oneDNN (CPU training), or on the measured kernels (CPU inference).
        prepack: inference linear layers run the kernel measured fastest for their number of rows and
            their shape (`kernels`), with the weight forms those kernels need made once (CPU).
        kernels: the inference kernel per row class (`shapes.ROW_CLASSES`) and shape kind
            (`shapes.shape_kind`), as (class, kind, kernel) triples (`cpu.kernel_triples`).
        fused_qkv: Q, K and V from one stacked product.
        torch_layers: encoder layers run PyTorch's fused layer (`fused.TorchEncoderLayer`) on many rows.
        absorbed_cross: decoding steps absorb cross-attention's W_Q and W_O into the memory where that reads
            less (`absorbed.AbsorbedCrossAttention`; CPU inference in float32).
        compile: run the prepared model through `torch.compile`.
        cuda_graphs: decoding steps captured once per search in a CUDA graph and replayed per token
            (`inference.steps.FixedState`; CUDA inference).
        int8_weights: (row class, shape kind) pairs where int8 weights were measured faster than the float32
            kernels (`calibrate.Choices.int8_weights`): int8 copies run them for layers over int8's tolerance.
        int8_float32: (row class, shape kind) pairs where int8 products were measured slower than the float32
            kernels at the model's widths (`calibrate.int8_kernels`): int8 copies run float32 there.
        int8_onednn: (row class, shape kind) pairs where oneDNN's int8 product was measured faster than fbgemm's
            (`calibrate.int8_kernels`; AMX): int8 layers run it there.
        float32_attention: bf16 training computes attention itself in float32 (`MultiHeadAttention.float32_attention`),
            where its bf16 kernel was measured the slower forward and backward (`calibrate.bf16_training_attention`).
        bits_dropout: CPU training draws dropout's masks as random integers (`dropout.BitsDropout`), where that was
            measured faster than `F.dropout`'s `bernoulli_` (`calibrate.bits_dropout_faster`).
        measured_threads: a decoding step, a search's encoding and an encoder-only model's pass (embeddings,
            labels) run on one thread at the rows where that was measured faster than on all the process's, timed on
            the prepared model itself the first time they meet those rows (CPU inference; `inference.threads`).
    """

    device: torch.device
    mode: str = "inference"
    precision: str = "fp32"
    onednn: bool = False
    prepack: bool = False
    fused_qkv: bool = False
    torch_layers: bool = False
    absorbed_cross: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    kernels: tuple[tuple[str, str, str], ...] | None = None
    int8_weights: tuple[tuple[str, str], ...] = ()
    int8_float32: tuple[tuple[str, str], ...] = ()
    int8_onednn: tuple[tuple[str, str], ...] = ()
    float32_attention: bool = False
    bits_dropout: bool = False
    measured_threads: bool = False

    @property
    def plain(self) -> bool:
        """True when the model's modules run as written (no trick applied)."""
        return not (self.onednn or self.prepack or self.fused_qkv or self.torch_layers or self.absorbed_cross
                    or self.compile or self.cuda_graphs or self.float32_attention or self.bits_dropout
                    or self.measured_threads)

    def describe(self) -> str:
        """A short label: device, mode, precision and tricks
        ("cpu inference fp32: kernels by rows (one wide columns/square dense/narrow dense, few packed, many
        packed), fused QKV"; a row class whose kinds agree is one word)."""
        measured = "kernels by rows (" + ", ".join(_row_kernels(self.kernels or ())) + ")"
        tricks = [name for name, on in (("int8 layer by layer, by measured error", self.precision == "int8"),
                                        ("int8 weights where int8 cannot hold the activations",
                                         self.precision == "int8" and bool(self.int8_weights)),
                                        ("float32 products where measured faster than int8 ("
                                         + ", ".join(f"{rows} {kind}" for rows, kind in self.int8_float32) + ")",
                                         self.precision == "int8" and bool(self.int8_float32)),
                                        ("oneDNN's int8 products where measured faster than fbgemm's ("
                                         + ", ".join(f"{rows} {kind}" for rows, kind in self.int8_onednn) + ")",
                                         self.precision == "int8" and bool(self.int8_onednn)),
                                        (measured if self.prepack else "oneDNN", self.onednn),
                                        ("fused QKV", self.fused_qkv),
                                        ("PyTorch's fused encoder layers", self.torch_layers),
                                        ("cross-attention absorbed into short memories", self.absorbed_cross),
                                        ("attention in float32 (faster here than bf16's)"
                                         + (" unless written out for its dropout" if self.bits_dropout else ""),
                                         self.float32_attention),
                                        ("dropout masks from random bits (faster here than bernoulli's)",
                                         self.bits_dropout),
                                        ("decoding steps and short encodings on one thread where measured faster",
                                         self.measured_threads and torch.get_num_threads() > 1),
                                        ("torch.compile", self.compile),
                                        ("decoding steps in CUDA graphs", self.cuda_graphs)) if on]
        return f"{self.device.type} {self.mode} {self.precision}: {', '.join(tricks) or 'plain'}"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context to run the prepared model in (bf16 training), else a no-op."""
        if self.mode == "train" and self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def prepare(self, model: nn.Module) -> nn.Module:
        """`model` made ready to run this way: moved to the device (in place), then a prepared copy.

        The copy has new modules but shares the model's parameters and buffers, so training it trains
        the model, and saving the model saves what it learned. Copies for inference may hold weights
        converted once (prepacked, stacked, bf16 or int8): prepare again after changing the weights.
        """
        model.to(self.device)
        if self.device.type == "cuda":
            _attention_off_cudnn()
        if self.precision == "int8":
            return self._int8_copy(model)
        if self.precision == "bf16" and self.mode == "inference":
            prepared = copy.deepcopy(model).to(torch.bfloat16)
        else:
            prepared = shared_copy(model)
        if self.torch_layers and self.mode == "inference":
            prepared = use_torch_encoder_layers(prepared)
        product = cpu.onednn_linear if self.onednn else F.linear
        if self.fused_qkv:
            frozen = None
            if self.mode == "inference":
                frozen = self._packed if self.prepack else (lambda w, b: StackedLinear(w, b, product))
            prepared = fuse_qkv(prepared, product=product, frozen=frozen)
        if self.absorbed_cross and self.mode == "inference":  # before use_onednn: it reads the plain projections
            absorb_cross_attention(prepared)
        if self.onednn:
            cpu.use_onednn(prepared, prepack=self._packed if self.prepack else None, skip=stacked_away(prepared))
            if self.prepack:
                prepared = cpu.fuse_activations(prepared)
        if self.float32_attention and self.mode == "train":
            for module in prepared.modules():
                if isinstance(module, MultiHeadAttention):
                    module.float32_attention = True
        if self.bits_dropout and self.mode == "train":
            use_bits_dropout(prepared)
        prepared.train(self.mode == "train")
        if self.mode == "inference" and not self.plain:
            _without_dropout(prepared)
        if self.cuda_graphs and self.mode == "inference":
            prepared.cuda_graphs = True  # read by `inference.steps.start`
        _mark_threads(prepared, self.precision if self.measured_threads and self.mode == "inference" else None)
        return torch.compile(prepared) if self.compile else prepared


    def _int8_copy(self, model: nn.Module) -> nn.Module:
        """An inference copy whose linear layers run in int8 where the measured error allows (`backends.int8`)."""
        prepared = shared_copy(model)
        if self.fused_qkv:
            prepared = fuse_qkv(prepared, product=F.linear, frozen=lambda w, b: StackedLinear(w, b, F.linear))
        prepared.eval()
        _without_dropout(prepared)
        fallback = None  # where int8 is too far: bf16 where the CPU has it natively, else float32
        if native_bf16_cpu(self.device):
            fallback = int8.Bf16Linear
        elif self.kernels is not None:
            fallback = self._packed
        else:
            fallback = _float32_layer
        float32 = None  # where int8 was measured slower than float32, float32 products
        if self.int8_float32:
            float32 = int8.Float32Rows(_by_rows(self.int8_float32),
                                       self._packed if self.kernels is not None else _float32_layer)
        with torch.no_grad():
            choices = int8.quantize(prepared, int8.calibration_run(model), fallback=fallback,
                                    reduce_range=int8.int8_range() == "reduced",
                                    int8_weights_rows=_by_rows(self.int8_weights),
                                    float32=float32, onednn_rows=_by_rows(self.int8_onednn))
        kinds = Counter(choice.kind for choice in choices)
        logger.info("int8 copy: %s", ", ".join(f"{n} {kind}" for kind, n in kinds.items()))
        _mark_threads(prepared, self.precision if self.measured_threads else None)
        return prepared

    def _packed(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        """An inference linear layer running this backend's measured kernels for its shape."""
        return cpu.PackedLinear.on_kernels(weight, bias, self.kernels or ())


def with_kernels(backend: Backend, kernels: tuple[tuple[str, str, str], ...], *, fused_qkv: bool,
                 torch_layers: bool = False) -> Backend:
    """`backend` for inference on the measured `kernels` (`cpu.kernel_triples`): prepacked oneDNN forms where any
    kernel is not PyTorch's default, and the measured fused Q/K/V and fused encoder layers."""
    swap = any(kernel != "dense" for _, _, kernel in kernels)
    return replace(backend, onednn=swap, prepack=swap, kernels=kernels, fused_qkv=fused_qkv, torch_layers=torch_layers)


def _row_kernels(kernels: tuple[tuple[str, str, str], ...]) -> list[str]:
    """ "one columns" where every shape kind of a row class runs one kernel, else "one wide columns/square dense"."""
    by_rows: dict[str, list[tuple[str, str]]] = {}
    for rows, kind, kernel in kernels:
        by_rows.setdefault(rows, []).append((kind, kernel))
    return [f"{rows} {kinds[0][1]}" if len({k for _, k in kinds}) == 1
            else f"{rows} " + "/".join(f"{kind} {k}" for kind, k in kinds) for rows, kinds in by_rows.items()]


def _pairs(by_rows: dict[str, dict[str, bool | str]], value: bool | str) -> tuple[tuple[str, str], ...]:
    """The (row class, shape kind) pairs where a measurement by row class and shape kind (whether something paid, or
    the kernel chosen) is `value`."""
    return tuple((rows, kind) for rows, by_kind in by_rows.items() for kind, measured in by_kind.items()
                 if measured == value)


def _by_rows(pairs: tuple[tuple[str, str], ...]) -> dict[str, dict[str, bool]]:
    """(row class, shape kind) pairs as row class -> shape kind -> True, as `int8.row_classes` reads them."""
    by_rows: dict[str, dict[str, bool]] = {}
    for rows, kind in pairs:
        by_rows.setdefault(rows, {})[kind] = True
    return by_rows


def _float32_layer(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A float32 inference linear layer over a fixed weight, by `F.linear`."""
    return StackedLinear(weight, bias, F.linear)


def _without_dropout(model: nn.Module) -> None:
    """Every `nn.Dropout` of an inference copy replaced by `nn.Identity`, in place: at inference dropout is the
    identity already, and a decoding step at batch 1 calls about 25 of them, each a Python call for nothing."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                setattr(module, name, nn.Identity())


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules that shares its parameters and buffers (no tensor is copied)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=memo)


def weights_version(model: nn.Module) -> tuple | None:
    """Identity and version counter of every parameter: changes when a weight is replaced or written in place.

    None for inference tensors, which have no version counter.
    """
    try:
        return tuple((p.data_ptr(), p._version) for p in model.parameters())
    except RuntimeError:
        return None


# The narrowest model whose training bf16 autocast speeds up on a GPU. Measured on an H200 (`aiayn bench train
# --device cuda`, every batch shape seen once first): d_model 256 trained at 0.89x fp32's tokens a second (the
# step is bound by launching kernels, and autocast adds casts), d_model 512 at 1.10x.
CUDA_BF16_TRAIN_MIN_WIDTH = 512


def native_bf16_cpu(device: torch.device) -> bool:
    """Whether `device` is a CPU that computes bf16 natively and runs oneDNN's products: where bf16 inference runs
    over weights prepacked in bf16 (`select`), and may be chosen for a model by measurement
    (`aiayn.inference.translator.measured_precision`)."""
    return device.type == "cpu" and bf16_supported(device) and cpu.onednn_usable()


def default_precision(device: torch.device, mode: str, train_shape: tuple[int, int, int] | None = None) -> str:
    """bf16 on a CUDA GPU that computes it natively (for training, a model at least `CUDA_BF16_TRAIN_MIN_WIDTH`
    wide; `train_shape` None is a base model); for training on a CPU with native bf16, bf16 where a step of the
    model's widths was measured faster so (`calibrate.bf16_training_faster`); else fp32."""
    if mode == "train" and native_bf16_cpu(device):
        rows, d_model, d_ff = train_shape or (calibrate.TRAIN_SHAPE_ROWS, BASE_WIDTH, 4 * BASE_WIDTH)

        def prepare(precision: str, model: nn.Module) -> tuple:
            backend = select(device, "train", precision, train_shape=(rows, d_model, d_ff))
            return backend.prepare(model), backend.autocast

        return "bf16" if calibrate.bf16_training_faster(rows, d_model, d_ff, prepare) else "fp32"
    if device.type != "cuda" or not bf16_supported(device):
        return "fp32"
    if mode == "train" and train_shape is not None and train_shape[1] < CUDA_BF16_TRAIN_MIN_WIDTH:
        return "fp32"
    return "bf16"


def _attention_off_cudnn() -> None:
    """Leave cuDNN out of `scaled_dot_product_attention`'s kernels, for the process (flash, memory-efficient and
    math remain; every model in it is affected, plain ones and other libraries' too). PyTorch sends masked bf16
    attention to cuDNN first on Hopper and later GPUs, and cuDNN builds an execution plan for every new shape it
    sees, 0.4-1 s each: aiayn's batches change shape from step to step (bucketed lengths in training, each
    request's length in translation), so most steps would pay for a plan."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        logger.info("cuDNN attention left out of scaled_dot_product_attention: it plans anew for every shape")


def inference_shape(model: nn.Module) -> tuple[int, int, int, int]:
    """(d_model, d_ff, vocabulary, weight bytes) of `model`, for `select(..., inference_shape=...)`; the vocabulary
    is 0 where the model has no projection onto it (an encoder giving hidden states or labels), so that no
    calibration times a product it never runs."""
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return cfg.d_model, cfg.d_ff, cfg.target_vocab_size if cfg.projects_to_vocabulary else 0, weight_bytes


def select(device: str | torch.device | None = None, mode: str = "inference", precision: str | None = None, *,
           plain: bool = False, compile: bool = False, train_shape: tuple[int, int, int] | None = None,
           inference_shape: tuple[int, int, int, int] | None = None) -> Backend:
    """Decide how to run on `device` (default: the best available) in `mode`, from what this machine can use.

    Args:
        device: "cpu", "cuda", "mps" (or "cuda:1"), None for the best available.
        mode: "train" or "inference".
        precision: "fp32", "bf16" or "int8"; None picks per device (`default_precision`): bf16 on a CUDA GPU
            that has it (for training, on models at least 512 wide), bf16 training on a CPU with native bf16 where
            measured faster at the model's widths, else fp32.
        plain: run the modules as written (only the device and precision apply).
        compile: also `torch.compile` the prepared model (CUDA and CPU; off by default).
        train_shape: (batch tokens, d_model, d_ff) of the model to train: its products and Q/K/V are chosen by
            what was measured at those widths (`calibrate.training_choices`); None: at a base model's.
        inference_shape: (d_model, d_ff, vocabulary, weight bytes) of the model to run (`inference_shape` of a
            model): its products are chosen by what was measured at those widths (`calibrate.inference_kernels`);
            None: at a base model's.

    Raises:
        ValueError: an unknown mode or precision, a device this machine lacks, int8 outside CPU inference.
    """
    device = resolve_device(device)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if precision is None:
        precision = "fp32" if plain else default_precision(device, mode, train_shape)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "int8" and (mode != "inference" or device.type != "cpu"):
        raise ValueError("int8 runs inference on CPU only; use --device cpu, or fp32 / bf16")
    if precision == "int8" and int8.int8_usable() is None:
        raise ValueError("this PyTorch build has no int8 products (quantized::linear_dynamic); use fp32 or bf16")
    if precision == "bf16" and not bf16_supported(device):
        logger.warning("%s has no native bfloat16 support; bf16 will be slower than fp32 here", device.type)
    backend = Backend(device, mode, precision)
    if plain:
        return backend
    if precision == "bf16" and mode == "inference" and native_bf16_cpu(device):
        # bf16 weights, half float32's bytes to stream, each product on the kernel measured fastest for its rows and
        # shape: oneDNN over the weight prepacked in bf16, or PyTorch's own product (a bf16 F.linear would take
        # oneDNN over the unpacked weight, repacking it on every call: docs/notes.md, "Decoding").
        kernels = cpu.kernel_triples(calibrate.bf16_kernels(*(inference_shape or BASE_INFERENCE_SHAPE)))
        return replace(with_kernels(backend, kernels, fused_qkv=True), absorbed_cross=True, compile=compile,
                       measured_threads=True)
    if device.type == "cpu" and precision == "bf16" and mode == "train":
        # autocast over the products; the attention kernel in whichever precision ran faster at the model's width
        rows, d_model = train_shape[:2] if train_shape is not None else (calibrate.TRAIN_SHAPE_ROWS, BASE_WIDTH)
        return replace(backend, fused_qkv=True, compile=compile, bits_dropout=calibrate.bits_dropout_faster(),
                       float32_attention=calibrate.bf16_training_attention(rows, d_model))
    if device.type != "cpu" or precision == "bf16":
        graphs = device.type == "cuda" and mode == "inference" and not compile
        return replace(backend, fused_qkv=True, compile=compile, cuda_graphs=graphs)
    if mode == "train":  # a model's own shapes where given, else a base model's
        if train_shape is not None:
            onednn, fused_qkv = calibrate.training_choices(*train_shape)
        else:
            measured = _measured()
            onednn, fused_qkv = measured.train_onednn, measured.fused_qkv_train
        return replace(backend, onednn=onednn and cpu.onednn_usable(), fused_qkv=fused_qkv, compile=compile,
                       bits_dropout=calibrate.bits_dropout_faster())
    # Inference: measured at the model's own widths where given (a narrow model does not wait for a base one's
    # shapes), else at a base model's.
    measured = None if inference_shape else _measured()
    kernels = cpu.kernel_triples(calibrate.inference_kernels(*inference_shape) if inference_shape
                                 else measured.inference)
    if precision == "int8":  # the layers int8 leaves in float32 run the measured kernels, or int8 weights
        pays = _pairs(calibrate.int8_weight_choices(*inference_shape or ()), True)
        # float32 where int8's per-call quantisation costs more than the float32 product (narrow models); oneDNN's
        # int8 product where faster than fbgemm's (AMX)
        int8_kernels = calibrate.int8_kernels(*inference_shape or BASE_INFERENCE_SHAPE)
        return replace(backend, fused_qkv=True, kernels=kernels, int8_weights=pays,
                       int8_float32=_pairs(int8_kernels, "float32"),
                       int8_onednn=_pairs(int8_kernels, "int8 onednn"), measured_threads=True)
    fused_qkv, torch_layers = (calibrate.inference_layers(*inference_shape) if inference_shape
                               else (measured.fused_qkv_inference, measured.torch_layers_inference))
    # Cross-attention absorbed into the memory reads less wherever it applies (a rule measured on both CPU kinds).
    return replace(with_kernels(backend, kernels, fused_qkv=fused_qkv,
                                torch_layers=torch_layers), absorbed_cross=True, compile=compile,
                   measured_threads=True)


# The shape `select` measures bf16 products at where it is given none: a base model's widths and vocabulary
# (`shapes.SHAPE_KINDS`), its weights as many bytes as one- and few-row products are timed over.
BASE_WIDTH = dict(SHAPE_KINDS)["square"][0]  # a base model's d_model
BASE_INFERENCE_SHAPE = (*dict(SHAPE_KINDS)["wide"], dict(SHAPE_KINDS)["vocabulary"][1], calibrate.COLD_BYTES)


def _mark_threads(prepared: nn.Module, precision: str | None) -> None:
    """Mark a prepared copy whose passes have their threads measured in `precision` (read by `inference.threads`), or
    take the mark off a copy of a marked one (a copy of a copy carries its attributes)."""
    if precision is None:
        prepared.__dict__.pop("measured_threads", None)
    else:
        prepared.measured_threads = precision


def _measured() -> calibrate.Choices:
    """This machine's choices at a base model's shapes (measured the first time asked, then cached)."""
    measured = calibrate.choices()
    logger.debug("CPU products on this machine (%s): %s", calibrate.cache_path(measured.machine), measured.describe())
    return measured

