"""The indexer's and relay's Prometheus metrics, each defined once, and what observes them.

In `chatmem up` / `serve --with-workers` these land in the API's /metrics (one process,
one registry); `chatmem indexer` and `chatmem relay` serve them on METRICS_PORT.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter, Histogram

from memory.recall.embeddings import Embedder
from memory.recall.fact_keys import FactAnswer

BATCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

TURNS_INDEXED = Counter("chatmem_indexer_turns_indexed_total", "Turns written to the memory index.")
CHUNKS_INDEXED = Counter("chatmem_indexer_chunks_total", "Memory chunks upserted.")
MESSAGES_CONSUMED = Counter("chatmem_indexer_messages_total", "Messages committed by the indexer.")
BATCHES = Counter("chatmem_indexer_batches_total", "Batches committed by the indexer.")
RETRIED_BATCHES = Counter(
    "chatmem_indexer_retried_batches_total", "Batches given back because the database or broker was away."
)
DEAD_LETTERS = Counter("chatmem_indexer_dead_letters_total", "Messages dead-lettered, by reason.", ["reason"])
BATCH_SECONDS = Histogram(
    "chatmem_indexer_batch_seconds", "Indexing one batch, poll to commit excluded.", buckets=BATCH_BUCKETS
)
INDEX_LAG = Histogram(
    "chatmem_indexer_lag_seconds",
    "From a turn's completion (payload completed_at, else created_at) to its batch being committed.",
    buckets=LAG_BUCKETS,
)
EMBEDDING_BATCH_SECONDS = Histogram(
    "chatmem_embedding_batch_seconds",
    "One embedding call of the indexer (a whole batch).",
    buckets=BATCH_BUCKETS,
)
EMBEDDING_TEXTS = Counter("chatmem_embedding_texts_total", "Texts embedded by the indexer.")
REUSED_VECTORS = Counter(
    "chatmem_indexer_reused_vectors_total",
    "Chunk vectors the indexer took from the API process's recall instead of encoding them again.",
)
KEYS_INDEXED = Counter(
    "chatmem_indexer_keys_total", "Search keys upserted beside the chunks, by kind.", ["kind"]
)
FACT_REQUESTS = Counter(
    "chatmem_indexer_fact_requests_total",
    "Fact-key requests to the rewrite model, by outcome (facts, none, junk, timeout, error).",
    ["outcome"],
)
FACT_SECONDS = Histogram(
    "chatmem_indexer_fact_seconds", "One fact-key request to the rewrite model.", buckets=BATCH_BUCKETS
)
RELAY_PUBLISHED = Counter("chatmem_relay_published_total", "Outbox rows published to Kafka and marked.")
RELAY_FAILURES = Counter("chatmem_relay_failures_total", "Relay publish attempts that failed (then retried).")


def _finished_at(payload: Any) -> datetime | None:
    if not isinstance(payload, dict):
        return None
    raw = payload.get("completed_at") or payload.get("created_at")
    if not isinstance(raw, str):
        return None
    try:
        stamp = datetime.fromisoformat(raw)
    except ValueError:
        return None
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)


def observe_committed(payloads: Sequence[Any], seconds: float, now: datetime | None = None) -> None:
    """Record one committed batch: its duration, its size, and each turn's lag from completion."""
    BATCHES.inc()
    MESSAGES_CONSUMED.inc(len(payloads))
    BATCH_SECONDS.observe(max(seconds, 0.0))
    current = now or datetime.now(UTC)
    for payload in payloads:
        finished = _finished_at(payload)
        if finished is not None:
            INDEX_LAG.observe(max((current - finished).total_seconds(), 0.0))


def observe_indexed(turns: int, chunks: int, *, sentences: int = 0, facts: int = 0) -> None:
    """Count turns, chunks and keys written by one pipeline call."""
    TURNS_INDEXED.inc(max(turns, 0))
    CHUNKS_INDEXED.inc(max(chunks, 0))
    KEYS_INDEXED.labels(kind="sentence").inc(max(sentences, 0))
    KEYS_INDEXED.labels(kind="fact").inc(max(facts, 0))


def observe_reused_vectors(count: int) -> None:
    """Count chunk vectors one pipeline call reused instead of encoding."""
    REUSED_VECTORS.inc(max(count, 0))


def observe_fact_answer(answer: FactAnswer) -> None:
    """Count one fact-key request by how it ended, and time it."""
    FACT_REQUESTS.labels(outcome=answer.outcome).inc()
    FACT_SECONDS.observe(max(answer.seconds, 0.0))


def observe_dead_letter(reason: str) -> None:
    """Count one dead-lettered message; `reason` is poison or failed."""
    DEAD_LETTERS.labels(reason=reason).inc()


class TimedEmbedder:
    """An embedder that records how long each batch took; everything else is the wrapped one's."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.dim = inner.dim

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Embed with the wrapped model, timing the call."""
        started = time.perf_counter()
        try:
            return await self.inner.embed(texts)
        finally:
            EMBEDDING_BATCH_SECONDS.observe(time.perf_counter() - started)
            EMBEDDING_TEXTS.inc(len(texts))
