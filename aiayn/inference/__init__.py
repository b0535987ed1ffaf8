"""Using a trained model: generation (greedy, beam, sampling on a KV cache), sentence embeddings and search."""

from aiayn.inference.embeddings import Embedder
from aiayn.inference.generation import GenerationConfig, GenerationOutput, generate
from aiayn.inference.search import SearchIndex

__all__ = ["Embedder", "GenerationConfig", "GenerationOutput", "SearchIndex", "generate"]
