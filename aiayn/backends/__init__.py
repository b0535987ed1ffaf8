"""The one place that decides how a model runs on a device: select a backend, then prepare the model once.

`aiayn.nn` holds plain modules that call their sub-layers; everything that makes them faster on a
particular machine (oneDNN products and prepacked weights on CPU, stacked Q/K/V, bf16, int8,
`torch.compile`) is swapped in from outside by `Backend.prepare`, and `aiayn verify` checks every
path this machine can use against the plain one and the oracles.

The modules import one way: `shapes` (row classes and shape kinds) and `hooks` -> the kernels (`cpu`,
`fused`, `int8`, `absorbed`) -> `calibrate` (times the kernels) -> `backend` (`Backend`, `select`).
"""

from aiayn.backends.backend import (
    MODES,
    PRECISIONS,
    Backend,
    inference_shape,
    select,
    shared_copy,
    weights_version,
)
from aiayn.backends.devices import (
    available_devices,
    bf16_supported,
    describe_device,
    model_device,
    resolve_device,
    usable_cores,
)

__all__ = ["MODES", "PRECISIONS", "Backend", "available_devices", "bf16_supported", "describe_device",
           "inference_shape", "model_device", "resolve_device", "select", "shared_copy", "usable_cores",
           "weights_version"]
