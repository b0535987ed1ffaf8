"""Devices: which ones this machine has, the best of them, and what each can do (for `aiayn verify`)."""

from __future__ import annotations

import os

import torch

DEVICE_TYPES = ("cpu", "cuda", "mps")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system has one, else all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def over_cores(given: str, cores: int) -> str:
    """The one phrase for a thread or process count above the cores: `--threads 8 is more than the 2 cores this
    process may use` (`given`: the count as the user wrote it)."""
    return f"{given} is more than the {cores} cores this process may use"


def threads_within_cores(threads: int, given: str, doing: str) -> tuple[int, str | None]:
    """(`threads`, None) where this process may run on that many cores; else (the cores, the warning that says so:
    `--threads 8 is more than the 2 cores this process may use: serving with 2 threads`). More threads than cores
    only make them wait for each other; `doing` names what runs with them."""
    cores = usable_cores()
    if threads <= cores:
        return threads, None
    return cores, f"{over_cores(given, cores)}: {doing} with {cores} threads"


def available_devices() -> list[str]:
    """The device types this machine and PyTorch build can run on, best first ("cuda", "mps", "cpu")."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if torch.backends.mps.is_available():
        found.append("mps")
    return [*found, "cpu"]


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device to run on: `device` if this machine has it, the best available one for None or "auto".

    Raises:
        ValueError: an unknown name, or a device this machine does not have (the message names the ones it has).
    """
    if device is None or device == "auto":
        return torch.device(available_devices()[0])
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICE_TYPES)}") from None
    if resolved.type not in DEVICE_TYPES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICE_TYPES)}")
    if resolved.type not in available_devices():
        raise ValueError(f"device {resolved.type!r} is not available on this machine (it has: "
                         f"{', '.join(available_devices())}); pass --device cpu or leave --device out")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"there is no {resolved} here ({torch.cuda.device_count()} CUDA devices); "
                         "pass --device cuda:0")
    return resolved


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's first parameter (or buffer) lives; CPU for a model without tensors."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def bf16_supported(device: torch.device) -> bool:
    """Whether `device` computes bfloat16 natively (CUDA from Ampere; CPUs with AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def describe_device(device: torch.device) -> str:
    """One line on the device: its name and the capabilities the backends care about."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kernels = [name for name, on in (("flash", torch.backends.cuda.flash_sdp_enabled()),
                                         ("memory-efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
                                         ("math", torch.backends.cuda.math_sdp_enabled())) if on]
        return (f"cuda: {props.name}, compute capability {props.major}.{props.minor}, bf16 "
                f"{'yes' if bf16_supported(device) else 'no'}, SDPA kernels {'/'.join(kernels)}")
    if device.type == "mps":
        return "mps: Apple GPU"
    capability = torch.backends.cpu.get_cpu_capability()
    onednn = "available" if torch.backends.mkldnn.is_available() else "not built in"
    return (f"cpu: {capability} kernels, oneDNN {onednn}, bf16 {'native' if bf16_supported(device) else 'emulated'}, "
            f"{torch.get_num_threads()} threads")
