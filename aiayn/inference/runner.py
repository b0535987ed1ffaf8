"""What every task object holds: the model, the backend that runs it, and the backend's prepared copy."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.backends import select, weights_version


class ModelRunner:
    """A model in eval mode on its device, run through the device's fast path (`aiayn.backends`).

    Args:
        model: the model; moved to the backend's device.
        device: "cpu", "cuda", "mps" or None for the best available.
        precision: "fp32" (the model up to float32 rounding), "bf16" or "int8" (faster, approximate);
            None: the device's default (bf16 on a GPU that has it, else fp32).
        plain: run the modules as written, without the device's fast path.
    """

    def __init__(self, model: nn.Module, *, device: str | torch.device | None = None, precision: str | None = "fp32",
                 plain: bool = False):
        self.backend = select(device, "inference", precision, plain=plain)
        self.model = model.to(self.backend.device).eval()
        self._prepared: tuple[tuple | None, nn.Module] | None = None  # (weights' version, prepared model)

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self.backend.device

    def prepared_model(self) -> nn.Module:
        """The model as the backend prepared it (once, and again whenever a weight changed since)."""
        version = weights_version(self.model)
        if self._prepared is None or self._prepared[0] != version:  # None: inference tensors, no versions to tell
            self._prepared = (version, self.backend.prepare(self.model))
        return self._prepared[1]
