"""CPU int8 inference: linear layers with int8 weights and activations quantised per call, chosen layer by layer.

- Weights: symmetric int8, one scale per output channel (row of W).
- Activations: quantised when the layer is called (dynamic), unsigned 8 bits with one scale and zero
  point per call, over the full 0..255 range where this CPU's int8 products do not saturate (VNNI;
  `int8_usable` checks once), else PyTorch's reduced 7-bit range. The product is fbgemm's
  (`quantized::linear_dynamic`), which quantises, multiplies and rescales in one call, or, for the rows where
  calibration measured it faster (`calibrate.int8_kernels`), oneDNN's over the same int8 values
  (`onednn::qlinear_pointwise`), which runs on AMX's tiles where the CPU has them: fbgemm's kernels stop at
  AVX-512 VNNI, a half to a third of oneDNN's speed there at a batch's rows (docs/notes.md, "Decoding").
- Smoothing (SmoothQuant, Xiao et al. 2022): a few input channels of a LayerNorm's output carry values
  tens of times larger than the rest, and one scale per call then leaves the others a few levels.
  Dividing input channel c by s_c = sqrt(max|x_c| / max|W_:,c|) and multiplying the weight's column c
  by it moves that range into the weights, where every row has its own scale. max|x_c| comes from a
  calibration pass on random token ids, so no data is needed.
- Per layer, by measuring: each layer runs whichever of int8 and smoothed int8 is closer to float32 on
  the calibration inputs; if even that is further than `tolerance` (relative error of the layer's
  output), the layer stays in bfloat16 (CPUs with native bf16) or float32. In a sentence encoder the
  layers fed by GELU (the FFN's second layer) are the ones that stay.

`quantize` applies all of it to a copy `aiayn.backends.Backend.prepare` made; nothing else calls it.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends.fused import StackedLinear
from aiayn.backends.shapes import row_class, shape_kind

logger = logging.getLogger(__name__)

# Relative output error above which a layer is not run in int8, on either activation range (docs/notes.md).
# On the reduced range a layer's int8 error is about twice the full range's (half the levels); holding it to
# half the tolerance there kept most layers in float32, no faster than before, for no measured gain in BLEU.
TOLERANCE = 0.02
LEVELS = {"full": 255, "reduced": 127}  # activation levels of each range
SMOOTHING_ALPHA = 0.5  # SmoothQuant's migration strength: the range split evenly between input and weight
CALIBRATION_SHAPE = (8, 32)  # random sequences x tokens of the calibration pass


@functools.cache
def int8_usable() -> str | None:
    """How this build and CPU run fbgemm's dynamic int8 product: "full" (0..255 activations, exact
    sums), "reduced" (0..127, where 8-bit pairs would saturate 16-bit sums), or None (unavailable)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's quantised tensors carry a deprecation notice
            k = 64
            x = torch.ones(1, k)
            x[0, 0] = 0.0  # quantises to 255 everywhere but the first column
            layer = Int8Linear(torch.ones(4, k), None, reduce_range=False)
            exact = bool(torch.allclose(layer(x), torch.full((1, 4), float(k - 1)), rtol=1e-4))
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        logger.info("int8 products unavailable (%s)", err)
        return None
    return "full" if exact else "reduced"


@functools.cache
def onednn_int8_usable() -> bool:
    """Whether this build has oneDNN's int8 product (`Int8Linear.onednn_product`) and, on this CPU, it computes what
    fbgemm's does (the same quantised values; the sums in another order)."""
    if not hasattr(torch.ops.onednn, "qlinear_pointwise") or int8_usable() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(16, 64, generator=gen), torch.randn(3, 64, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            layer = Int8Linear(weight, torch.randn(16, generator=gen)).on_onednn(frozenset({"one"}))
            return bool(torch.allclose(layer.onednn_product(x), layer.int8_product(x), rtol=1e-4, atol=1e-4))
        except (RuntimeError, NotImplementedError, AttributeError) as err:
            logger.info("oneDNN int8 products unavailable (%s)", err)
            return False


def int8_range() -> str | None:
    """The activation range int8 layers use on this machine: `int8_usable()`, or "reduced" where
    `AIAYN_INT8_RANGE=reduced` asks for it (to check the reduced path on a CPU that has the full one)."""
    usable = int8_usable()
    return "reduced" if usable and os.environ.get("AIAYN_INT8_RANGE") == "reduced" else usable


def step_ratio(reduce_range: bool) -> float:
    """How much larger the activation step is on the given range than on the full one (1 or 255 / 127)."""
    return LEVELS["full"] / LEVELS["reduced" if reduce_range else "full"]


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (per output channel) and x quantised per call (fbgemm), inference only.

    Args:
        weight: (out, in) float weight; bias: (out,) or None.
        smooth: (in,) positive factors s; the layer computes (x / s) (W diag(s))^T + b, the same map
            with the input's range moved into the weight. None: no smoothing.
        reduce_range: quantise activations to 0..127 (CPUs whose int8 sums saturate).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, smooth: torch.Tensor | None = None,
                 reduce_range: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float()
        if smooth is not None:
            weight = weight * smooth  # column c times s_c
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127  # (out,) symmetric, -127..127
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's quantised tensors carry a deprecation notice
            qweight = torch.quantize_per_channel(weight, scales.double(), torch.zeros_like(scales, dtype=torch.long),
                                                 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())
        self.inv_smooth = None if smooth is None else (1.0 / smooth).contiguous()
        self.reduce_range = reduce_range
        self.smoothed = smooth is not None
        self.float32: nn.Module | None = None  # the same map in float32, for the row classes of `float32_rows`
        self.float32_rows: frozenset[str] = frozenset()
        self.onednn: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.onednn_rows: frozenset[str] = frozenset()  # the row classes run by `onednn_product`

    def on_onednn(self, rows: frozenset[str]) -> Int8Linear:
        """This layer, running oneDNN's int8 product (`onednn_product`) on the row classes `rows`: where it was
        measured faster than fbgemm's (`calibrate.int8_kernels`). The same int8 weight, prepacked once more for
        oneDNN. Returns the layer."""
        if rows:
            qweight, bias = torch.ops.quantized.linear_unpack(self.packed)
            scales = qweight.q_per_channel_scales().float()  # (out,)
            self.onednn = (torch.ops.onednn.qlinear_prepack(qweight.int_repr(), None), scales,
                           torch.zeros(self.out_features, dtype=torch.long), None if bias is None else bias.float())
        self.onednn_rows = frozenset(rows)
        return self

    def on_float32(self, rows: frozenset[str], layer: nn.Module) -> Int8Linear:
        """This layer, running `layer` (float32, the same weight and bias) on the row classes `rows`: where int8 was
        measured slower than float32 (`calibrate.int8_kernels`). Returns the layer."""
        self.float32_rows, self.float32 = rows, layer
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, smoothed={self.smoothed}"
                + (f", float32 rows={'/'.join(sorted(self.float32_rows))}" if self.float32 is not None else "")
                + (f", oneDNN rows={'/'.join(sorted(self.onednn_rows))}" if self.onednn_rows else ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) float32 -> (..., out_features) float32."""
        return self.product(row_class(x.numel() // max(self.in_features, 1)))(x)

    def product(self, rows: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> this layer's output for inputs of the row class `rows`: float32's, oneDNN's or fbgemm's product."""
        if self.float32 is not None and rows in self.float32_rows:
            return self.float32
        return self.onednn_product if rows in self.onednn_rows else self.int8_product

    def int8_product(self, x: torch.Tensor) -> torch.Tensor:
        """fbgemm's int8 product, whatever the rows (`forward` runs the one `product` gives their row class)."""
        x = x * self.inv_smooth if self.inv_smooth is not None else x.contiguous()
        return torch.ops.quantized.linear_dynamic(x, self.packed, self.reduce_range)

    def onednn_product(self, x: torch.Tensor) -> torch.Tensor:
        """The same product on oneDNN (after `on_onednn`): x quantised as fbgemm quantises it (0..255, or 0..127 on
        the reduced range, one scale and zero point per call), the int32 sums rescaled to float32 with the bias
        inside the product."""
        packed, scales, zero_points, bias = self.onednn
        if x.numel() == 0:
            return self.int8_product(x)  # no range to quantise over
        scaled = x * self.inv_smooth if self.inv_smooth is not None else x
        try:
            rows = torch.quantize_per_tensor_dynamic(scaled.reshape(-1, self.in_features), torch.quint8,
                                                     self.reduce_range)
        except RuntimeError:  # an input that is not finite has no range either: fbgemm's product, as elsewhere
            return self.int8_product(x)
        out = torch.ops.onednn.qlinear_pointwise(rows.int_repr(), rows.q_scale(), rows.q_zero_point(), packed, scales,
                                                 zero_points, bias, 1.0, 0, torch.float32, "none", [], "")  # (N, out)
        return out.view(*x.shape[:-1], self.out_features)


class Bf16Linear(nn.Module):
    """A float32-in, float32-out linear layer computed in bfloat16 on oneDNN (weight prepacked once)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().bfloat16(), None)
        self.bias = None if bias is None else bias.detach().bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., out_features), float32."""
        return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), self.packed, self.bias, "none", [], "").float()


def int8_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (out, in) as symmetric int8 (out, in) with one bfloat16 scale per output channel (out,)."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1).clamp_min(1e-12) / 127).bfloat16()  # (out,)
    q = (weight / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def int8_weights_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) float32 @ (q diag(scales))^T + bias -> (..., out) float32: weights read as int8 and scaled inside
    ATen's product (`_weight_int8pack_mm`, the kernel of gpt-fast's int8 decoding), x rounded to bfloat16."""
    rows = x.reshape(-1, x.shape[-1]).bfloat16()  # (N, in)
    out = torch._weight_int8pack_mm(rows, q, scales).float()  # (N, out)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], q.shape[0])


@functools.cache
def int8_weights_usable() -> bool:
    """Whether this build has ATen's int8-weight product on CPU, and it computes x W^T within bfloat16's rounding."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(16, 64, generator=gen), torch.randn(3, 64, generator=gen)
    try:
        q, scales = int8_weights(weight)
        out = int8_weights_product(x, q, scales, None)
    except (RuntimeError, NotImplementedError) as err:
        logger.info("int8-weight products unavailable (%s)", err)
        return False
    return bool(torch.allclose(out, x @ weight.t(), rtol=0.05, atol=0.05))


class Int8WeightsLinear(nn.Module):
    """y = x W^T + b with W stored in int8 (per output channel) and x in bfloat16 for the product, on the row classes
    where calibration measured it faster than the float32 kernels (`calibrate.Choices.int8_weights`); other calls
    (an encoder's many rows) run `fallback`. Only the weight is quantised: its error does not depend on the
    activations' range, so a layer whose activations int8 cannot hold may still run here.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, rows: frozenset[str], fallback: nn.Module):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.q, self.scales = int8_weights(weight)
        self.bias = None if bias is None else bias.detach().float()
        self.rows, self.fallback = rows, fallback

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={'/'.join(sorted(self.rows))}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) float32 -> (..., out_features) float32."""
        if row_class(x.numel() // max(self.in_features, 1)) not in self.rows:
            return self.fallback(x)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The int8-weight product itself, whatever the rows (`forward` sends some to the fallback)."""
        return int8_weights_product(x, self.q, self.scales, self.bias)


def row_classes(by_rows: dict[str, dict[str, bool]] | None, weight: torch.Tensor) -> frozenset[str]:
    """The row classes where `by_rows` (row class -> shape kind -> measured so) holds for `weight`'s shape kind."""
    kind = shape_kind(*reversed(weight.shape))
    return frozenset(name for name, by_kind in (by_rows or {}).items() if by_kind.get(kind))


@dataclass(frozen=True)
class Float32Rows:
    """Where an int8 copy runs float32 products instead of int8 ones: `rows` (row class -> shape kind -> True) where
    int8 was measured slower (`calibrate.int8_kernels`), each run by `layer(weight, bias)`."""

    rows: dict[str, dict[str, bool]]
    layer: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]


def _where_faster(layer: Int8Linear, weight: torch.Tensor, bias: torch.Tensor | None, float32: Float32Rows | None,
                  onednn_rows: dict[str, dict[str, bool]] | None) -> Int8Linear:
    """`layer`, on float32 for the row classes `float32` gives its shape kind, on oneDNN's int8 product for those
    `onednn_rows` gives it."""
    rows = frozenset() if float32 is None else row_classes(float32.rows, weight)
    layer = layer.on_float32(rows, float32.layer(weight, bias)) if rows else layer
    onednn = row_classes(onednn_rows, weight) - rows
    return layer.on_onednn(onednn) if onednn and onednn_int8_usable() else layer


@dataclass(frozen=True)
class LayerChoice:
    """How one linear layer runs after `quantize`, and the relative error measured for int8."""

    name: str
    kind: str  # "int8", "int8 smoothed", or the fallback's name
    int8_error: float


def _weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight, module.bias


def _linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every `nn.Linear` (subclasses too) and frozen Q/K/V stack of `model`, by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, StackedLinear))}


def calibration_run(model: nn.Module, seed: int = 0) -> Callable[[nn.Module], object] | None:
    """A call of `model` on the random inputs it makes for itself (`example_inputs`: token ids clear of the special
    entries, or hidden states), or None for a module that makes none."""
    example_inputs = getattr(model, "example_inputs", None)
    if example_inputs is None:
        return None
    args = example_inputs(*CALIBRATION_SHAPE, torch.Generator().manual_seed(seed))
    return lambda m: m(*args)


def calibration_inputs(model: nn.Module, layers: dict[str, nn.Module],
                       run: Callable[[nn.Module], object]) -> dict[str, torch.Tensor]:
    """The inputs (N, in) each layer receives while `run(model)` executes (layers never called are absent)."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [layer.register_forward_hook(
        lambda module, args, out, name=name: seen.setdefault(name, []).append(
            args[0].detach().reshape(-1, args[0].shape[-1]).float()))
        for name, layer in layers.items()]
    try:
        with torch.no_grad():
            run(model)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(rows) for name, rows in seen.items()}


def smoothing_factors(x: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant's s_c = max|x_c| ** alpha / max|W_:,c| ** (1 - alpha) for inputs x (N, in), weight (out, in).

    Both maxima are raised to at least their median over the channels: a channel that calibration saw
    (nearly) silent, such as a ReLU unit that random inputs never open, would otherwise be multiplied
    by a huge 1 / s_c and, on a real input that opens it, overflow the range of every other channel.
    """
    act = x.abs().amax(dim=0)  # (in,)
    wmax = weight.detach().float().abs().amax(dim=0)  # (in,)
    act = act.clamp_min(float(act.median().clamp_min(1e-5)))
    wmax = wmax.clamp_min(float(wmax.median().clamp_min(1e-5)))
    return act.pow(alpha) / wmax.pow(1 - alpha)


def relative_error(layer: nn.Module, x: torch.Tensor, expected: torch.Tensor) -> float:
    """||layer(x) - expected|| / ||expected||, Frobenius norms."""
    with torch.no_grad():
        return float((layer(x) - expected).norm() / expected.norm().clamp_min(1e-12))


def choose(name: str, module: nn.Module, x: torch.Tensor, *, reduce_range: bool, tolerance: float,
           fallback: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None,
           int8_weights_rows: dict[str, dict[str, bool]] | None = None,
           float32: Float32Rows | None = None,
           onednn_rows: dict[str, dict[str, bool]] | None = None) -> tuple[nn.Module, LayerChoice]:
    """The layer to run in place of `module` (calibration inputs x (N, in)), and why: int8 (float32 on the row classes
    `float32` says int8 is slower), else int8 weights where `int8_weights_rows` (row class -> shape kind -> measured
    faster) says they pay, else `fallback`; an int8 layer runs oneDNN's product on the row classes `onednn_rows` gives
    its shape kind."""
    weight, bias = _weight_and_bias(module)
    with torch.no_grad():
        expected = F.linear(x, weight.float(), None if bias is None else bias.float())  # (N, out)
    plain = Int8Linear(weight, bias, reduce_range=reduce_range)
    smoothed = Int8Linear(weight, bias, smooth=smoothing_factors(x, weight), reduce_range=reduce_range)
    errors = {"int8": relative_error(plain, x, expected), "int8 smoothed": relative_error(smoothed, x, expected)}
    kind = min(errors, key=errors.get)
    if errors[kind] <= tolerance or fallback is None:
        layer = plain if kind == "int8" else smoothed
        return _where_faster(layer, weight, bias, float32, onednn_rows), LayerChoice(name, kind, errors[kind])
    replacement = fallback(weight, bias)
    rows = row_classes(int8_weights_rows, weight)
    if rows:  # int8 weights where measured faster, if they keep the full range's tolerance (see the class)
        weights_only = Int8WeightsLinear(weight, bias, rows=rows, fallback=replacement)
        error = relative_error(weights_only.product, x, expected)
        if error <= TOLERANCE:
            return weights_only, LayerChoice(name, "int8 weights", error)
    return replacement, LayerChoice(name, type(replacement).__name__, errors[kind])


def quantize(model: nn.Module, run: Callable[[nn.Module], object] | None, *, reduce_range: bool,
             tolerance: float | None = None,
             fallback: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None = None,
             int8_weights_rows: dict[str, dict[str, bool]] | None = None,
             float32: Float32Rows | None = None,
             onednn_rows: dict[str, dict[str, bool]] | None = None) -> list[LayerChoice]:
    """Replace, in place, the linear layers of `model` that `run(model)` calls by int8 (or fallback) layers.

    Args:
        model: an inference copy (its Q/K/V stacks already frozen); its own parameters are not changed.
        run: calls the model on calibration inputs; None quantises every linear layer, unsmoothed, unmeasured.
        reduce_range: see `Int8Linear`.
        tolerance: largest relative output error of a layer run in int8 (default: `TOLERANCE`).
        fallback: builds the layer for those over the tolerance (bf16 or float32); None keeps them int8.
        int8_weights_rows: where int8 weights (`Int8WeightsLinear`) were measured faster than the fallback's
            float32 kernels, by row class and shape kind; such layers over the tolerance run them where their own
            error stays within `TOLERANCE`.
        float32: where int8 layers run float32 products instead, by shape kind and row class (None: nowhere).
        onednn_rows: where int8 layers run oneDNN's int8 product instead of fbgemm's, by row class and shape kind
            (row class -> shape kind -> True; None: nowhere).

    Returns:
        What each replaced layer became.
    """
    tolerance = TOLERANCE if tolerance is None else tolerance
    layers = _linear_layers(model)
    if run is None:
        inputs = {}
        targets = {name: None for name in layers}
    else:
        inputs = calibration_inputs(model, layers, run)
        targets = inputs
    choices = []
    modules = dict(model.named_modules())
    for name in targets:
        if not name:
            continue  # the model itself is one linear layer: nothing to replace it in
        module = layers[name]
        if name in inputs:
            replacement, choice = choose(name, module, inputs[name], reduce_range=reduce_range, tolerance=tolerance,
                                         fallback=fallback, int8_weights_rows=int8_weights_rows, float32=float32,
                                         onednn_rows=onednn_rows)
        else:
            weight, bias = _weight_and_bias(module)
            replacement = _where_faster(Int8Linear(weight, bias, reduce_range=reduce_range), weight, bias, float32,
                                        onednn_rows)
            choice = LayerChoice(name, "int8", float("nan"))
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, replacement)
        choices.append(choice)
    return choices
