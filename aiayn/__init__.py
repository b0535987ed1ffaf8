"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) on PyTorch."""

from aiayn.config import ModelConfig, preset
from aiayn.io import load_model, save_model
from aiayn.nn.model import EncoderDecoderModel, EncoderModel, build_model

__version__ = "0.1.0"
__all__ = ["ModelConfig", "preset", "build_model", "EncoderDecoderModel", "EncoderModel", "load_model",
           "save_model", "__version__"]
