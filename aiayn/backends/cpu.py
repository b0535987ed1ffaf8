"""CPU: linear layers on oneDNN (forward and backward; weights prepacked for inference). int8: `backends.int8`.

PyTorch sends a float32 `F.linear` on CPU to MKL. On AMD processors MKL does not take its AVX-512
kernels: a matrix-vector product (one decoding step at batch 1) streams the weight at about a third
of the memory bandwidth, and the products of a training step run at a half to a fifth of the speed
oneDNN (PyTorch's other CPU library, `torch.ops.mkldnn`) reaches on the same tensors. oneDNN with
the weight reordered once into its blocked layout ("prepacked", what inductor does for the same job)
is faster again at inference. The sums run in another order, so results equal `F.linear`'s up to
float32 rounding (about 1e-6); `aiayn verify` and the oracle tests check both paths.

Nothing here decides when to use it: `aiayn.backends.select` does, once, from what the machine can
use (`onednn_usable`), and `Backend.prepare` swaps these modules in.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from aiayn.backends.shapes import ROW_CLASSES, row_class, shape_kind
from aiayn.nn.feedforward import PositionwiseFeedForward

logger = logging.getLogger(__name__)


KERNELS = ("packed", "columns", "dense", "aten")  # see aiayn.backends.calibrate
# What a PackedLinear runs where no measurement says otherwise: oneDNN, but MKL for one row.
DEFAULT_KERNELS = {"one": "columns", "few": "packed", "many": "packed"}


def kernel_triples(inference: dict[str, dict[str, str]]) -> tuple[tuple[str, str, str], ...]:
    """Kernels by row class and shape kind (`calibrate.Choices.inference`) as (row class, shape kind, kernel) triples,
    the form `Backend.kernels` and `PackedLinear.on_kernels` take."""
    return tuple((rows, kind, kernel) for rows, by_kind in inference.items() for kind, kernel in by_kind.items())

# Activations oneDNN applies inside a product: name -> (post-op, algorithm, the same function in torch, in place).
# In place because the product's output is a new tensor: an activation writing another one of a batch's FFN size
# would touch fresh memory on every call, which costs as much as a product of the layer's (docs/notes.md).
POST_OPS = {
    "relu": ("relu", "", torch.relu_),
    "gelu": ("gelu", "none", lambda x: torch.ops.aten.gelu_(x)),
    "gelu_tanh": ("gelu", "tanh", lambda x: torch.ops.aten.gelu_(x, approximate="tanh")),
}


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in)^T + bias (out,) -> (..., out) by oneDNN, unconditionally.

    `weight` may be a plain (strided, even transposed) tensor or one prepacked by
    `torch.ops.mkldnn._reorder_linear_weight`.
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinearFunction(torch.autograd.Function):
    """F.linear with oneDNN products in forward and backward: y = x W^T + b, dx = dy W, dW = dy^T x, db = sum dy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (N, in), weight (out, in), bias (out,) or None -> (N, out)."""
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_product(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()  # (N, out)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_product(grad, weight.t())  # dy W: (N, in)
        if ctx.needs_input_grad[1]:
            grad_weight = onednn_product(grad.t(), x.t())  # dy^T x: (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)  # (out,)
        return grad_x, grad_weight, grad_bias


def _applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Plain float32 CPU tensors of linear shapes, outside autocast, tracing and compilation."""
    if torch.is_autocast_enabled("cpu") or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(type(t) not in (torch.Tensor, nn.Parameter) for t in tensors):
        return False
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and x.dim() >= 2 and weight.dim() == 2 and x.shape[-1] == weight.shape[1] and x.numel() > 0)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on oneDNN where it applies (see `_applies`), else `F.linear` itself.

    Under autograd the products of the backward pass run on oneDNN too.
    """
    if not _applies(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        x_2d = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in)
        return _OneDnnLinearFunction.apply(x_2d, weight, bias).view(*x.shape[:-1], weight.shape[0])  # (..., out)
    return onednn_product(x, weight, bias)


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose product runs on oneDNN (forward and backward): the same parameters and state_dict."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> OneDnnLinear:
        """A OneDnnLinear holding `linear`'s own weight and bias (no copy)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., out_features)."""
        return onednn_linear(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    """An inference-only CPU linear layer (float32 or bf16) whose product runs the kernel measured fastest for its rows.

    `kernels` maps each row class of `shapes.ROW_CLASSES` ("one", "few", "many") to a kernel:
    "packed" (oneDNN over the weight reordered once into its blocked layout), "columns" (MKL over
    the weight transposed, (in, out) contiguous, made on first use), "dense" (F.linear over the
    weight as given, shared with the model) or "aten" (the same with oneDNN off: PyTorch's own kernels, whose bf16
    matrix-vector product streams a weight faster than oneDNN's, where a bf16 F.linear would take oneDNN's; it holds
    the packed form too, which it runs where another Python thread may be computing: `_without_onednn`). Only
    the forms some row class uses are held. The packed
    and transposed forms are copies taken when the layer is built: they have no gradient and do not
    follow later changes of the original weight (prepare the model again after training it further).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, activation: str | None = None,
                 kernels: dict[str, str] | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernels = dict(kernels or DEFAULT_KERNELS)
        if not set(self.kernels.values()) <= set(KERNELS) or set(self.kernels) != {n for n, _ in ROW_CLASSES}:
            raise ValueError(f"kernels must map {', '.join(n for n, _ in ROW_CLASSES)} to one of "
                             f"{', '.join(KERNELS)}, got {self.kernels}")
        used = set(self.kernels.values())
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if "packed" in used else None
            if "aten" in used and self.packed is None:
                with contextlib.suppress(RuntimeError):  # a CPU that cannot pack bf16: F.linear beside threads
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.weight = weight.detach() if used & {"dense", "aten"} else None  # (out, in), shared with the model
        self.bias = None if bias is None else bias.detach().clone()
        self.columns: torch.Tensor | None = None  # (in, out): the weight transposed, made on first use
        if "columns" in used and self.packed is None and self.weight is None:
            self.columns = weight.detach().t().contiguous()
        if activation is not None and activation not in POST_OPS:
            raise ValueError(f"no oneDNN post-op for activation {activation!r}; choose one of {', '.join(POST_OPS)}")
        self.activation = activation

    @classmethod
    def on_kernels(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                   kernels: tuple[tuple[str, str, str], ...]) -> PackedLinear:
        """The layer running `kernels` ((row class, shape kind, kernel) triples) of its weight's shape kind
        (`shapes.shape_kind`), `DEFAULT_KERNELS` for a row class they leave out."""
        kind = shape_kind(weight.shape[1], weight.shape[0])
        chosen = dict(DEFAULT_KERNELS)
        chosen.update({rows: kernel for rows, of_kind, kernel in kernels if of_kind == kind})
        return cls(weight, bias, kernels=chosen)

    def extra_repr(self) -> str:
        kernels = ", ".join(f"{rows}={kernel}" for rows, kernel in self.kernels.items())
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernels=({kernels})" + (f", activation={self.activation}" if self.activation else ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., out_features)."""
        if torch.is_grad_enabled():
            raise RuntimeError("this model was prepared for inference (prepacked weights, no gradients): call it "
                               "under torch.no_grad(), or prepare it with mode='train'")
        return self.function(x.numel() // max(self.in_features, 1))(x)

    def function(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> this layer's output for inputs of `rows` rows, as one plain function of x: the kernel chosen for their
        row class, its activation after it, without `forward`'s checks (a decoding step holds it for as long as its
        rows stay in one row class: `aiayn.inference.parts`). Made from the kernels and activation as they are now."""
        kernel = self.kernels[row_class(rows)]
        name, algorithm, activate = POST_OPS[self.activation] if self.activation else ("none", "", None)
        weight, bias = self.weight, self.bias
        if kernel == "packed":
            packed, pointwise = self.packed, torch.ops.mkldnn._linear_pointwise

            def product(x: torch.Tensor) -> torch.Tensor:
                return pointwise(x, packed, bias, name, [], algorithm)  # the activation inside
            return product
        if kernel == "columns":
            plain = self._by_columns
        elif kernel == "aten":
            packed = self.packed

            def plain(x: torch.Tensor) -> torch.Tensor:
                return _without_onednn(x, weight, bias, packed)
        else:
            def plain(x: torch.Tensor) -> torch.Tensor:
                return F.linear(x, weight, bias)
        if activate is None:
            return plain

        def activated(x: torch.Tensor) -> torch.Tensor:
            return activate(plain(x))
        return activated

    def _by_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) by MKL's product over the weight transposed."""
        if self.columns is None:  # made from the dense or packed form the layer also holds
            dense = self.weight if self.weight is not None else self.packed.to_dense()
            self.columns = dense.t().contiguous()  # (in, out)
        rows = x.reshape(-1, self.in_features)  # (N, in)
        out = torch.mm(rows, self.columns) if self.bias is None else torch.addmm(self.bias, rows, self.columns)
        return out.view(*x.shape[:-1], self.out_features)  # (..., out)


class _OneDnnOff:
    """PyTorch's oneDNN switch (`torch.backends.mkldnn.enabled`) off while any thread is inside, then as it was.

    The switch is process-wide, so `_without_onednn` enters only where no other Python thread runs. Counted, so that
    threads entering and leaving in any order would leave it as they found it."""

    def __init__(self):
        self.lock, self.inside, self.was = threading.Lock(), 0, True

    def __enter__(self) -> None:
        with self.lock:
            if self.inside == 0:
                self.was = torch.backends.mkldnn.enabled
                torch.backends.mkldnn.enabled = False
            self.inside += 1

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.inside -= 1
            if self.inside == 0:
                torch.backends.mkldnn.enabled = self.was


_onednn_off = _OneDnnOff()


def _without_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    packed: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on PyTorch's own kernels, oneDNN off for the call (`_OneDnnOff`), where this is the process's only
    Python thread; else oneDNN's product over `packed`, the same weight prepacked (`F.linear` as the switch stands
    where the CPU could not pack it). The switch is process-wide, and
    another thread's call may read it more than once: PyTorch's bf16 attention on a CPU with AMX decides on oneDNN's
    kernels, then checks the switch again and raises ("BFloat16 Brgemm VNNI format is only supported ...") where it
    changed in between, as it did with a translator's batches side by side."""
    if not only_thread():
        return F.linear(x, weight, bias) if packed is None else onednn_product(x, packed, bias)
    return aten_linear(x, weight, bias)


def only_thread() -> bool:
    """Whether this is the process's only Python thread: where the "aten" kernel may turn PyTorch's process-wide
    oneDNN switch off, to run or to be timed, with no other thread computing meanwhile."""
    return threading.active_count() == 1


def aten_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with oneDNN off for the call, whatever other threads do: the "aten" kernel itself, as calibration
    times it (one measurement at a time, when a model is prepared)."""
    with _onednn_off:
        return F.linear(x, weight, bias)


class PackedFeedForward(nn.Module):
    """The position-wise feed-forward network at inference with its activation inside the first product.

    `linear1` is a `PackedLinear` that applies the activation to its output (a oneDNN post-op where its kernel is
    oneDNN's, in place after the product otherwise), so the activation costs no pass of its own over the hidden
    layer (GELU's saves most; measured: docs/notes.md). Built by `fuse_activations` from a
    `PositionwiseFeedForward`, whose linear layers and dropout it takes.
    """

    def __init__(self, ffn: PositionwiseFeedForward, activation: str):
        super().__init__()
        self.linear1, self.dropout, self.linear2 = ffn.linear1, ffn.dropout, ffn.linear2
        self.linear1.activation = activation
        self.train(ffn.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d_model) -> (B, L, d_model); positions never mix."""
        hidden = self.linear1(x)  # (B, L, d_ff), activated
        return self.linear2(self.dropout(hidden))


def fuse_activations(model: nn.Module) -> nn.Module:
    """Replace each feed-forward network whose first layer is a `PackedLinear` (inference) and whose activation
    oneDNN has by a `PackedFeedForward`, in place.

    Returns the model (a new object only when `model` itself is such a network).
    """
    if isinstance(model, PositionwiseFeedForward):
        return _with_fused_activation(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, PositionwiseFeedForward):
                setattr(module, name, _with_fused_activation(child))
    return model


def _with_fused_activation(ffn: PositionwiseFeedForward) -> nn.Module:
    """`ffn` as a `PackedFeedForward` where its first layer and activation allow, else `ffn` itself."""
    name = activation_name(ffn.activation)
    if name is None or not isinstance(ffn.linear1, PackedLinear) or ffn.linear1.activation is not None:
        return ffn
    return PackedFeedForward(ffn, name)


def activation_name(module: nn.Module) -> str | None:
    """The `POST_OPS` name of an activation module, None for one oneDNN cannot fuse."""
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    return None


def use_onednn(model: nn.Module, *, prepack: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None,
               skip: frozenset[int] = frozenset()) -> None:
    """Swap every `nn.Linear` in `model` (subclasses too, but not a `OneDnnLinear` already) for
    `prepack(weight, bias)` (inference) or a `OneDnnLinear` (training, prepack None), in place.

    Layers whose `id` is in `skip` stay as they are (for example projections an inference copy never calls).
    """
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and not isinstance(child, OneDnnLinear) and id(child) not in skip:
                setattr(module, name, prepack(child.weight, child.bias) if prepack is not None
                        else OneDnnLinear.from_linear(child))


@functools.cache
def onednn_usable() -> bool:
    """Whether this build and CPU run oneDNN's products, prepacked and not, forward and backward, equal to F.linear.

    Checked once per process on small tensors; anything missing or different means the plain path.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.randn(5, 24, generator=gen, requires_grad=True)  # (N, in)
            weight = torch.randn(16, 24, generator=gen, requires_grad=True)  # (out, in)
            bias = torch.randn(16, generator=gen)
            expected = F.linear(x, weight, bias)
            grads = torch.autograd.grad(expected.square().sum(), (x, weight))
            actual = onednn_linear(x, weight, bias)
            fast_grads = torch.autograd.grad(actual.square().sum(), (x, weight))
            with torch.no_grad():
                packed = PackedLinear(weight, bias)(x)
        pairs = [(actual, expected), (packed, expected), *zip(fast_grads, grads)]
        ok = all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in pairs)
    except (RuntimeError, NotImplementedError) as err:
        logger.info("oneDNN linear products unavailable (%s); using F.linear", err)
        return False
    if not ok:
        logger.warning("oneDNN linear products disagree with F.linear on this machine; using F.linear")
    return ok
