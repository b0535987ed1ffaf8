"""A small cosine-similarity search index over sentence vectors, saved as one `.npz` file and rebuilt when stale."""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from aiayn.inference.embeddings import Embedder

logger = logging.getLogger(__name__)


def corpus_digest(texts: Iterable[str]) -> str:
    """SHA-256 of a corpus (its texts in order); an index is rebuilt when this changes."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


class SearchIndex:
    """Unit vectors of a corpus, searched by cosine similarity (one matrix product).

    Args:
        texts: the corpus, one text per row.
        vectors: (N, d) float32 unit vectors (`build` normalises them).
        digest: `corpus_digest(texts)` and the embedder's settings, to tell when to rebuild.
    """

    def __init__(self, texts: list[str], vectors: np.ndarray, *, digest: str):
        if vectors.ndim != 2 or vectors.shape[0] != len(texts):
            raise ValueError(f"{len(texts)} texts but vectors of shape {vectors.shape}")
        self.texts = texts
        self.vectors = vectors.astype(np.float32, copy=False)
        self.digest = digest

    @staticmethod
    def key(texts: Sequence[str], embedder: Embedder) -> str:
        """What an index depends on: the corpus, the model, pooling and length limit."""
        settings = f"{embedder.name}|{embedder.pooling}|{embedder.max_length}"
        return corpus_digest([settings, *texts])

    @classmethod
    def build(cls, texts: Sequence[str], embedder: Embedder, *, batch_size: int = 16,
              progress: Callable[[int], None] | None = None) -> SearchIndex:
        """Embed `texts` into a new index."""
        texts = list(texts)
        vectors = embedder.embed(texts, batch_size=batch_size, progress=progress)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # cosine = dot product
        return cls(texts, vectors, digest=cls.key(texts, embedder))

    def search(self, query: np.ndarray, k: int = 5) -> list[tuple[int, float]]:
        """The `k` rows nearest a (d,) query vector: (row, cosine) pairs, best first."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if query.shape != (self.vectors.shape[1],):
            raise ValueError(f"query of shape {query.shape} does not match vectors of width {self.vectors.shape[1]}")
        query = query / max(float(np.linalg.norm(query)), 1e-12)
        scores = self.vectors @ query.astype(np.float32)  # (N,)
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(i), float(scores[i])) for i in top]

    def save(self, path: str | Path) -> Path:
        """Write the index as one `.npz` file (atomically)."""
        from aiayn.io import atomic_write_bytes

        buffer = io.BytesIO()
        # Texts as UTF-8 JSON bytes: a fixed-width string array would pad every row to the longest.
        texts = np.frombuffer(json.dumps(self.texts, ensure_ascii=False).encode("utf-8"), dtype=np.uint8)
        np.savez(buffer, vectors=self.vectors, texts=texts, digest=np.array(self.digest))
        path = Path(path)
        atomic_write_bytes(path, buffer.getvalue())
        return path

    @classmethod
    def load(cls, path: str | Path) -> SearchIndex:
        """Read what `save` wrote."""
        try:
            with np.load(Path(path), allow_pickle=False) as data:
                texts = json.loads(data["texts"].tobytes().decode("utf-8"))
                return cls(texts, data["vectors"], digest=str(data["digest"]))
        except (OSError, KeyError, ValueError, UnicodeDecodeError):
            # numpy's own reason (its allow_pickle advice for a text file, say) would mislead
            raise ValueError(f"{path}: not an aiayn search index (an .npz archive of texts, vectors and a "
                             "digest)") from None

    @classmethod
    def load_or_build(cls, path: str | Path, texts: Sequence[str], embedder: Embedder, *,
                      batch_size: int = 16, progress: Callable[[int], None] | None = None) -> tuple[SearchIndex, bool]:
        """The saved index at `path` if it was built from these texts and settings, else a new one (saved).

        Returns:
            (index, rebuilt).
        """
        path = Path(path)
        key = cls.key(texts, embedder)
        if path.is_file():
            try:
                index = cls.load(path)
                if index.digest == key:
                    return index, False
                logger.info("%s is stale (corpus or settings changed); rebuilding", path)
            except ValueError as err:  # a file aiayn did not write: never replaced
                raise ValueError(f"{err}; it is left as it is: delete it or choose another index path") from None
        index = cls.build(texts, embedder, batch_size=batch_size, progress=progress)
        index.save(path)
        return index, True
