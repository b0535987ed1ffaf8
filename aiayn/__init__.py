"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) on PyTorch.

Use what you trained (or a BERT-family encoder) in a few lines:

    import aiayn
    translator = aiayn.load("runs/numbers")           # a run directory of `aiayn train`
    translator.translate(["twenty-one"], num_beams=4)  # -> ["einundzwanzig"]
    aiayn.load("runs/sentiment").predict("Great film!")   # Classifier: label and probabilities
    aiayn.load("runs/ner").predict("Anna lives in Paris")  # Tagger: a tag per word
    aiayn.load("minilm").embed("A sentence.")          # Embedder: one vector (a list gives a matrix)
    aiayn.load("runs/lm").generate("one hundred and", max_new_tokens=20)  # Generator: the continuation

`load` returns a Translator, Generator, Classifier, Tagger or Embedder by what the directory holds; each has
`from_pretrained` and `save_pretrained`. Build and train: `build_model(preset("base"))`,
`Trainer(load_run_config(...), "runs/x").fit()`. Decoding: `generate`, `GenerationConfig`.

The names below are imported on first use, so that `import aiayn` (and the CLI's start, where a
Ctrl-C must already be handled) does not wait for torch.
"""

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "ModelConfig": "aiayn.config", "preset": "aiayn.config", "build_model": "aiayn.nn.model",
    "EncoderDecoderModel": "aiayn.nn.model", "EncoderModel": "aiayn.nn.model",
    "DecoderOnlyModel": "aiayn.nn.model", "load_model": "aiayn.io",
    "save_model": "aiayn.io", "load": "aiayn.inference.loading", "Translator": "aiayn.inference.translator",
    "Generator": "aiayn.inference.generator",
    "Classifier": "aiayn.inference.classifiers", "Tagger": "aiayn.inference.classifiers",
    "Embedder": "aiayn.inference.embeddings", "generate": "aiayn.inference.generation",
    "GenerationConfig": "aiayn.inference.generation", "Trainer": "aiayn.training.loop",
    "TrainConfig": "aiayn.training.config", "load_run_config": "aiayn.training.config",
}
__all__ = ["load", "Translator", "Generator", "Classifier", "Tagger", "Embedder", "generate", "GenerationConfig",
           "Trainer", "TrainConfig", "load_run_config", "ModelConfig", "preset", "build_model", "EncoderDecoderModel",
           "EncoderModel", "DecoderOnlyModel", "load_model", "save_model", "__version__"]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'aiayn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
