"""Text embedders: the real sentence-transformers model and a deterministic fake for tests.

Encoding is CPU-bound, so ``embed`` runs it in a worker thread and lets only one encode
run at a time: on a 2-core machine two concurrent encodes just fight over the cores
(torch already uses both) and each takes twice as long.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from memory.keywords import search_terms
from memory.models import EMBEDDING_DIM


class Embedder(Protocol):
    """Turns texts into L2-normalised vectors of ``dim`` floats."""

    dim: int

    async def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


class SentenceTransformerEmbedder:
    """A sentence-transformers model, loaded once by ``load()`` and encoded off the event loop."""

    def __init__(self, model_name_or_path: str, *, batch_size: int = 64) -> None:
        self.model_name_or_path = model_name_or_path
        self.batch_size = batch_size
        self.dim = EMBEDDING_DIM
        self._model: Any = None
        # A thread lock, not an asyncio one: encode_sync may also be called from threads.
        self._encode_lock = threading.Lock()

    def load(self) -> None:
        """Load the model (synchronous; call it at startup, e.g. via ``asyncio.to_thread``)."""
        if self._model is not None:
            return
        if Path(self.model_name_or_path).exists():
            # A local folder never needs the hub; without this the library may still try it.
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["TRANSFORMERS_OFFLINE"] = "1"
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(self.model_name_or_path, device="cpu")
        # sentence-transformers 5 renamed the method; the old name warns.
        dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = dimension()
        if dim is not None:
            self.dim = int(dim)
        self._model = model

    def encode_sync(self, texts: Sequence[str]) -> list[list[float]]:
        """Encode in the calling thread (benchmarks and worker threads only)."""
        if self._model is None:
            self.load()
        if not texts:
            return []
        with self._encode_lock:
            vectors = self._model.encode(
                list(texts),
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return [[float(x) for x in row] for row in vectors]

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """L2-normalised embeddings of ``texts``, computed in a worker thread."""
        if not texts:
            return []
        return await asyncio.to_thread(self.encode_sync, list(texts))


class HashEmbedder:
    """A deterministic fake: hashed bag of keyword terms and character trigrams, normalised.

    Texts that share words (or, for Chinese, character bigrams) get similar vectors, so
    retrieval tests can reason about what should be found without loading a model.
    """

    def __init__(self, dim: int = EMBEDDING_DIM) -> None:
        self.dim = dim

    def _features(self, text: str) -> list[tuple[str, float]]:
        terms = search_terms(text).split()
        features = [(f"w:{term}", 1.0) for term in terms]
        for term in terms:
            padded = f" {term} "
            features.extend((f"c:{padded[i : i + 3]}", 0.3) for i in range(len(padded) - 2))
        return features

    def embed_one(self, text: str) -> list[float]:
        """The vector of one text."""
        vector = [0.0] * self.dim
        for feature, weight in self._features(text):
            digest = hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest()
            bucket = int.from_bytes(digest[:4], "little") % self.dim
            sign = 1.0 if digest[4] & 1 else -1.0
            vector[bucket] += sign * weight
        norm = math.sqrt(sum(x * x for x in vector))
        if norm == 0.0:
            # An empty text still needs a valid unit vector for cosine distance.
            vector[0] = 1.0
            return vector
        return [x / norm for x in vector]

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """L2-normalised hashed embeddings (cheap enough to compute on the loop)."""
        return [self.embed_one(text) for text in texts]
