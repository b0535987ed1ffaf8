"""Linear layers through oneDNN's matmul while decoding: `with onednn_linear(): ...` and `linear(module, x)`.

PyTorch sends a float32 `F.linear` on CPU to MKL. On AMD processors MKL does not take its AVX-512
kernels: a matrix-vector product (one decoding step at batch 1) streams the weight at about a third
of the memory bandwidth, and small matrix products run at half the speed oneDNN (PyTorch's other CPU
library, `torch.ops.mkldnn`) reaches with the same weights in their usual (out, in) layout. Decoding
a sentence is mostly such products, so `aiayn.generation` runs inside `onednn_linear()`.

The results equal `F.linear`'s up to float32 rounding (the sums run in another order); outside the
context, and whenever autograd, tracing, another dtype or device, or a module hook is involved, every
call is plain `F.linear` / `module(x)`, bit for bit as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

_ENABLED: ContextVar[bool] = ContextVar("onednn_linear", default=False)


@contextmanager
def onednn_linear(enabled: bool = True) -> Iterator[None]:
    """Inside the block, `linear` and `matmul` use oneDNN where it applies (inference, float32, CPU)."""
    token = _ENABLED.set(enabled and torch.backends.mkldnn.is_available())
    try:
        yield
    finally:
        _ENABLED.reset(token)


def _use_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if not _ENABLED.get() or torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x (..., in) @ weight (out, in)^T + bias (out,) -> (..., out)."""
    if _use_onednn(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; a plain `nn.Linear` without hooks goes through `matmul` (oneDNN inside the context)."""
    if type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        return matmul(x, module.weight, module.bias)
    return module(x)
