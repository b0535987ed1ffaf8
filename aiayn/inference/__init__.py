"""Using a trained model: the loaded objects (what `load` returns: Translator, Generator, Classifier, Tagger,
Embedder), generation (greedy, beam, sampling on a KV cache), sentence embeddings and search."""

from aiayn.inference.classifiers import Classifier, Prediction, Tagger, WordTag
from aiayn.inference.embeddings import Embedder
from aiayn.inference.generation import GenerationConfig, GenerationOutput, continue_prompts, generate
from aiayn.inference.generator import Completion, Generator
from aiayn.inference.loading import load
from aiayn.inference.search import SearchIndex
from aiayn.inference.translator import Translation, Translator

__all__ = ["Classifier", "Completion", "Embedder", "GenerationConfig", "GenerationOutput", "Generator", "Prediction",
           "SearchIndex", "Tagger", "Translation", "Translator", "WordTag", "continue_prompts", "generate", "load"]
