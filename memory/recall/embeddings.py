"""Text embedders: the real sentence-transformers model and a deterministic fake for tests.

Encoding is CPU-bound, so ``embed`` runs it in a worker thread and lets only one encode
run at a time: on a 2-core machine two concurrent encodes just fight over the cores
(torch already uses both) and each takes twice as long.

Every reply embeds its memory query, so under load many small ``embed`` calls arrive at
once. One text costs ~7 ms to encode here, 32 texts in one call ~1.8 ms each, and every
encode also holds the GIL for its Python parts, stalling the event loop. ``EncodeBatcher``
therefore joins the calls that queued while an encode was running into the next encode
call: an idle process encodes at once (no waiting window), a busy one in batches whose
size follows the load.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from memory.recall.keywords import search_terms
from memory.storage.models import EMBEDDING_DIM

if TYPE_CHECKING:
    from memory.config import Settings

log = logging.getLogger(__name__)


class Embedder(Protocol):
    """Turns texts into L2-normalised vectors of ``dim`` floats."""

    dim: int

    async def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


Vectors = list[list[float]]


class EncodeBatcher:
    """Runs a synchronous batch encoder in a worker thread, one call at a time, joining queued calls.

    Calls that arrive while an encode runs wait for the next one and share it (up to
    ``max_texts`` texts, but never splitting a call); each caller gets its own texts'
    vectors back, in order. A caller that is cancelled while waiting is left out.
    """

    def __init__(self, encode: Callable[[list[str]], Vectors], *, max_texts: int) -> None:
        self._encode = encode
        self.max_texts = max_texts
        self._queue: deque[tuple[list[str], asyncio.Future[Vectors]]] = deque()
        self._drainer: asyncio.Task[None] | None = None
        self.encode_calls = 0  # how many encode calls ran (for metrics and tests)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """The vectors of ``texts``, encoded in a worker thread together with other waiting calls."""
        if not texts:
            return []
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Vectors] = loop.create_future()
        self._queue.append((list(texts), future))
        drainer = self._drainer
        if drainer is None or drainer.done() or drainer.get_loop() is not loop:
            # A drainer of another (closed) loop can never finish: only this loop's calls are kept.
            self._queue = deque(item for item in self._queue if item[1].get_loop() is loop)
            # A fresh context: the drainer serves every request, so it must not keep the first
            # caller's tenant scope or log ids (memory/storage/tenancy.py).
            self._drainer = loop.create_task(
                self._drain(), name="embedding-batcher", context=contextvars.Context()
            )
        return await future

    def _next_batch(self) -> list[tuple[list[str], asyncio.Future[Vectors]]]:
        batch: list[tuple[list[str], asyncio.Future[Vectors]]] = []
        size = 0
        while self._queue:
            texts, future = self._queue[0]
            if future.done():  # its caller was cancelled
                self._queue.popleft()
                continue
            if batch and size + len(texts) > self.max_texts:
                break
            batch.append(self._queue.popleft())
            size += len(texts)
        return batch

    async def _drain(self) -> None:
        batch: list[tuple[list[str], asyncio.Future[Vectors]]] = []
        try:
            while batch := self._next_batch():
                texts = [text for call, _ in batch for text in call]
                self.encode_calls += 1
                try:
                    vectors = await asyncio.to_thread(self._encode, texts)
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                start = 0
                for call, future in batch:
                    if not future.done():
                        future.set_result(vectors[start : start + len(call)])
                    start += len(call)
        finally:
            # Cancelled with the loop: nobody would ever answer the callers still waiting.
            for _, future in [*batch, *self._queue]:
                if not future.done():
                    future.cancel()


# A batch is padded to its longest text, and a transformer's cost grows with the padded
# length, so a short query batched with a long turn costs as much as two long turns. Texts
# are therefore encoded shortest first, in batches of at most this many padded characters.
# Measured on one thread (all-MiniLM-L6-v2): a query with two 2,000-character turns 199 ->
# 137 ms; ten queries with four such turns 924 -> 292 ms; 64 turns of 40-1,500 characters
# (an indexer batch) 4.3 -> 2.5 s; 32 queries unchanged (113 ms, one batch).
PADDED_CHARS_PER_BATCH = 2000


def padded_batches(texts: Sequence[str], *, max_texts: int) -> list[list[int]]:
    """Indexes of ``texts`` in batches, shortest first, each padded to at most PADDED_CHARS_PER_BATCH."""
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in sorted(range(len(texts)), key=lambda i: len(texts[i])):
        # Sorted, so the text being added is the batch's longest.
        if batch and (len(batch) >= max_texts or (len(batch) + 1) * len(texts[i]) > PADDED_CHARS_PER_BATCH):
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


RUNTIMES = ("openvino", "torch")


class SentenceTransformerEmbedder:
    """A sentence-transformers model, loaded once by ``load()`` and encoded off the event loop.

    ``runtime`` "openvino" (the default of the settings) encodes through sentence-transformers'
    OpenVINO backend from a cached export of the local weights (memory/recall/encoder_cache.py):
    the same vectors as torch (cosine >= 0.9999, recall unchanged on both memory benchmarks)
    for about half the CPU (bench/encoder.py). If OpenVINO cannot be loaded or the export fails,
    ``load`` falls back to torch, logs why, and says so in ``runtime`` and ``fallback_reason``
    (the API shows them in /metrics and /readyz).
    """

    def __init__(
        self,
        model_name_or_path: str,
        *,
        batch_size: int = 64,
        runtime: str = "torch",
        cache_root: Path | None = None,
    ) -> None:
        if runtime not in RUNTIMES:
            raise ValueError(f"unknown embedding runtime {runtime!r} (one of {', '.join(RUNTIMES)})")
        self.model_name_or_path = model_name_or_path
        self.batch_size = batch_size
        self.requested_runtime = runtime
        self.runtime = runtime
        self.cache_root = cache_root
        self.fallback_reason: str | None = None
        self.source_sha256: str | None = None  # of the model's weights file (index provenance)
        self.graph_sha256: str | None = None  # of the exported graph's weights, for OpenVINO
        self.dim = EMBEDDING_DIM
        self._model: Any = None
        # A thread lock, not an asyncio one: encode_sync may also be called from threads.
        self._encode_lock = threading.Lock()
        # Concurrent queries (a few texts each) share encode calls; an indexer batch goes alone.
        self._batcher = EncodeBatcher(self.encode_sync, max_texts=batch_size)

    def twin(self) -> SentenceTransformerEmbedder:
        """Another copy of this model, with its own lock and batcher (call ``load()`` on it).

        The indexer inside an API process encodes with a twin: its batches then run on one
        thread while queries run on another, and a reply's query never waits behind an
        indexer batch (``bench/indexer_fairness.py``). It costs a second copy of the weights.
        """
        return SentenceTransformerEmbedder(
            self.model_name_or_path,
            batch_size=self.batch_size,
            runtime=self.runtime,  # a fallen-back model's twin does not try OpenVINO again
            cache_root=self.cache_root,
        )

    @property
    def spec(self) -> dict[str, Any]:
        """What makes this embedder's vectors (recorded with every vector it writes)."""
        spec: dict[str, Any] = {
            "model": Path(self.model_name_or_path).name or self.model_name_or_path,
            "source_sha256": self.source_sha256 or self.model_name_or_path,
            "runtime": self.runtime,
            "dim": self.dim,
        }
        if self.graph_sha256:
            spec["graph_sha256"] = self.graph_sha256
        return spec

    def load(self, *, threads: int = 0) -> None:
        """Load the model (synchronous; call it at startup, e.g. via ``asyncio.to_thread``).

        ``threads`` > 0 sets the encoder's threads (torch's intra-op threads for the whole
        process, and OpenVINO's inference threads). Measured on a busy 2-core machine, one
        query took 200–400 ms with two torch threads (each parallel step waits for a thread
        the OS has put aside) and 25–40 ms with one.
        """
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        if self._model is not None:
            return
        local = Path(self.model_name_or_path)
        if local.exists():
            # A local folder never needs the hub; without this the library may still try it.
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["TRANSFORMERS_OFFLINE"] = "1"
        if local.is_dir() and (local / "model.safetensors").is_file():
            from memory.recall.encoder_cache import weights_sha256

            self.source_sha256 = weights_sha256(local)
        if self.runtime == "openvino":
            try:
                model = self._load_openvino(local, threads)
            except Exception as exc:  # ImportError, a failed export, a broken cache: torch still works
                self.runtime = "torch"
                self.fallback_reason = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("OpenVINO encoder unavailable (%s); encoding with torch", self.fallback_reason)
            else:
                self._use(model)
                return
        from sentence_transformers import SentenceTransformer

        from memory.recall.encoder_cache import quiet_model_loading

        with quiet_model_loading():
            self._use(SentenceTransformer(self.model_name_or_path, device="cpu"))

    def _load_openvino(self, local: Path, threads: int) -> Any:
        from memory.recall.encoder_cache import openvino_export, quiet_model_loading

        if self.cache_root is None:
            raise ValueError("no cache directory for the OpenVINO export")
        folder, graph_sha256 = openvino_export(local, self.cache_root)
        from sentence_transformers import SentenceTransformer

        ov_config = {"INFERENCE_NUM_THREADS": str(threads)} if threads > 0 else {}
        with quiet_model_loading():
            model = SentenceTransformer(
                str(folder),
                backend="openvino",
                device="cpu",
                model_kwargs={"file_name": "openvino/openvino_model.xml", "ov_config": ov_config},
            )
        self.graph_sha256 = graph_sha256
        return model

    def _use(self, model: Any) -> None:
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
        vectors: list[list[float]] = [[] for _ in texts]
        with self._encode_lock:
            for batch in padded_batches(texts, max_texts=self.batch_size):
                encoded = self._encode_batch([texts[i] for i in batch])
                for i, row in zip(batch, encoded.tolist(), strict=True):
                    vectors[i] = row
        return vectors

    def _encode_batch(self, texts: list[str]) -> Any:
        """The normalised vectors of one batch: ``model.encode(texts, normalize_embeddings=True)``.

        The steps of sentence-transformers' (pinned) ``encode`` for one batch of text, without
        its per-call setup (argument checks, prompt and device resolution, length sort, progress
        bar), which cost ~1 ms of the ~7 ms a query takes. Same preprocessing, forward pass and
        normalisation, so the same vectors bit for bit.
        """
        import torch
        from sentence_transformers.util import batch_to_device

        model = self._model
        with torch.inference_mode():
            features = batch_to_device(model.preprocess(texts), model.device)
            embeddings = model(features)["sentence_embedding"]
            return torch.nn.functional.normalize(embeddings, p=2, dim=1).cpu().numpy()

    @property
    def encode_calls(self) -> int:
        """How many encode calls ``embed`` has made (fewer than its callers under load)."""
        return self._batcher.encode_calls

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """L2-normalised embeddings of ``texts``, computed in a worker thread with other waiting calls."""
        return await self._batcher.embed(texts)


class HashEmbedder:
    """A deterministic fake: hashed bag of keyword terms and character trigrams, normalised.

    Texts that share words (or, for Chinese, character bigrams) get similar vectors, so
    retrieval tests can reason about what should be found without loading a model.
    """

    def __init__(self, dim: int = EMBEDDING_DIM, *, seed: int = 0) -> None:
        self.dim = dim
        # Another seed hashes every feature elsewhere: a different encoder, as far as the index
        # is concerned (tests of index generations use two).
        self.seed = seed
        self.spec = {"runtime": "hash", "seed": seed, "dim": dim}

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
            digest = hashlib.blake2b(
                feature.encode("utf-8"), digest_size=8, salt=self.seed.to_bytes(8, "little")
            ).digest()
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


def configured_embedder(settings: Settings) -> SentenceTransformerEmbedder:
    """The embedder the settings name (not loaded yet)."""
    return SentenceTransformerEmbedder(
        settings.embedding_model,
        batch_size=settings.embedding_batch_size,
        runtime=settings.embedding_runtime,
        cache_root=settings.embedding_cache_dir or settings.data_dir / "encoders",
    )


async def load_embedder(settings: Settings, *, threads: int | None = None) -> Embedder:
    """The configured embedder, ready: the embedding service if EMBEDDING_BASE_URL is set, else the
    local model loaded off the event loop (``threads``: EMBEDDING_THREADS unless given)."""
    if settings.embedding_base_url:
        from memory.recall.embedding_service import open_service

        return await open_service(settings)
    embedder = configured_embedder(settings)
    await asyncio.to_thread(embedder.load, threads=settings.embedding_threads if threads is None else threads)
    return embedder
