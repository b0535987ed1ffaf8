"""Linear layers through oneDNN while training: `with onednn_training(): loss = ...; loss.backward()`.

PyTorch sends a float32 `F.linear` on CPU, and the matrix products of its backward, to MKL. On AMD
processors MKL does not take its AVX-512 kernels, and the products of a training step (a few hundred
tokens against 512..37,000-wide weights) run at a half to a fifth of the speed oneDNN (PyTorch's other
CPU library, `torch.ops.mkldnn`) reaches on the same tensors. Inside the context every float32 CPU
`F.linear` (so every `nn.Linear`, and the attention's stacked Q/K/V product) runs forward and backward
through oneDNN: y = x W^T + b, dx = dy W, dW = dy^T x, db = sum dy, the same products summed in another
order (float32 rounding differs, about 1e-7 relative). Other dtypes, bf16 autocast, other devices and
builds without oneDNN keep `F.linear`. The module `aiayn.nn.fast_linear` does the same for inference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from aiayn.nn.fast_linear import onednn_product


class _OneDnnLinear(torch.autograd.Function):
    """F.linear with oneDNN products in forward and backward."""

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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN: x (..., in) -> (..., out)."""
    x_2d = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in)
    return _OneDnnLinear.apply(x_2d, weight, bias).view(*x.shape[:-1], weight.shape[0])  # (..., out)


def _applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Plain float32 CPU tensors of linear shapes, outside autocast, tracing and compilation."""
    if torch.is_autocast_enabled("cpu") or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and x.dim() >= 2 and weight.dim() == 2 and x.shape[-1] == weight.shape[1] and x.numel() > 0
            and (bias is None or bias.shape == (weight.shape[0],)))


class _OneDnnLinearMode(TorchFunctionMode):
    """Routes `F.linear` calls to `_OneDnnLinear`; every other call runs unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _applies(x, weight, bias):
                return linear(x, weight, bias)
        return func(*args, **kwargs)


@contextmanager
def onednn_training(enabled: bool = True) -> Iterator[None]:
    """Inside the block (forward and backward), float32 CPU linear layers run on oneDNN where it is built in."""
    if not (enabled and torch.backends.mkldnn.is_available()):
        yield
        return
    with _OneDnnLinearMode():
        yield
