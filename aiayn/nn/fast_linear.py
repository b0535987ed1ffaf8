"""Linear layers through oneDNN's matmul at inference: `linear(module, x)`, switched by `onednn_linear()`.

PyTorch sends a float32 `F.linear` on CPU to MKL. On AMD processors MKL does not take its AVX-512
kernels: a matrix-vector product (one decoding step at batch 1) streams the weight at about a third
of the memory bandwidth, and matrix products run at half the speed oneDNN (PyTorch's other CPU
library, `torch.ops.mkldnn`) reaches with the same weights in their usual (out, in) layout.

So, by default, the model's linear layers run on oneDNN whenever autograd is off (inference,
`torch.no_grad()`, `torch.inference_mode()`) for float32 CPU tensors. `with onednn_linear(False):`
(or `set_onednn_default(False)`) gives plain `F.linear` back. The results equal `F.linear`'s up to
float32 rounding (the sums run in another order, about 1e-6); with autograd on, tracing, another
dtype or device, or a module hook, every call is plain `F.linear` / `module(x)`, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

_ENABLED: ContextVar[bool] = ContextVar("onednn_linear", default=True)


def set_onednn_default(enabled: bool) -> None:
    """Switch the inference oneDNN path on or off in the current context (this thread; new threads start on)."""
    _ENABLED.set(bool(enabled))


@contextmanager
def onednn_linear(enabled: bool = True) -> Iterator[None]:
    """Inside the block, `linear` and `matmul` use oneDNN where it applies (inference, float32, CPU)."""
    token = _ENABLED.set(enabled and torch.backends.mkldnn.is_available())
    try:
        yield
    finally:
        _ENABLED.reset(token)


def _use_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if not (_ENABLED.get() and torch.backends.mkldnn.is_available()):
        return False
    if torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32))


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in)^T + bias (out,) -> (..., out) by oneDNN, unconditionally.

    `weight` may be a plain (strided, even transposed) tensor or one pre-packed by
    `torch.ops.mkldnn._reorder_linear_weight`. Callers decide when oneDNN applies.
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x (..., in) @ weight (out, in)^T + bias (out,) -> (..., out)."""
    if _use_onednn(x, weight, bias):
        return onednn_product(x, weight, bias)
    return F.linear(x, weight, bias)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; a plain `nn.Linear` without hooks goes through `matmul` (oneDNN inside the context)."""
    if type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        return matmul(x, module.weight, module.bias)
    return module(x)
