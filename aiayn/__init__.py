"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) on PyTorch.

The names below are imported on first use, so that `import aiayn` (and the CLI's start, where a
Ctrl-C must already be handled) does not wait for torch.
"""

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "ModelConfig": "aiayn.config", "preset": "aiayn.config", "build_model": "aiayn.nn.model",
    "EncoderDecoderModel": "aiayn.nn.model", "EncoderModel": "aiayn.nn.model", "load_model": "aiayn.io",
    "save_model": "aiayn.io",
}
__all__ = ["ModelConfig", "preset", "build_model", "EncoderDecoderModel", "EncoderModel", "load_model",
           "save_model", "__version__"]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'aiayn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
