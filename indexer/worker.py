"""The indexer worker loop, the transport choice, and the `chatmem relay/indexer` entry points.

One batch at a time: poll → index (one database transaction) → dead letters (kept by the
transport, then their outbox rows marked dead and the watermarks moved past them, one database
transaction) → commit the transport. The transport is committed only after all of that is,
so a crash or an outage anywhere redelivers the batch: the idempotent upsert absorbs it, and
its dead letters are dead-lettered again (at least once).

Failures are sorted three ways:
- a payload that cannot be decoded or validated is poison forever; it is dead-lettered
  at once, since retrying a deterministic failure only delays the rest;
- a database or broker outage (connection lost, deadlock, timeout) is nobody's fault:
  the batch is given back uncommitted and retried with backoff, and counts against no
  message, so an outage never dead-letters healthy turns;
- anything else fails the batch, which is then indexed one message at a time; a message
  that fails `indexer_max_attempts` times is dead-lettered with its error, the rest go on.

SIGTERM sets the stop event: the batch in hand is finished and committed, then the
consumer leaves. Cancelling `run` instead abandons the batch (rolled back, redelivered).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import asyncpg
from sqlalchemy import exc as sa_exc

from memory.config import Settings
from memory.recall.embedding_service import EmbeddingServiceError
from memory.recall.embeddings import Embedder, load_embedder
from memory.recall.fact_keys import FactAsker
from memory.recall.index import IndexChanged, MemoryIndex, open_index
from memory.recall.vector_cache import VectorCache
from memory.storage.db import Database

from . import metrics
from .health import Readiness, serve_health
from .kafka_transport import KafkaQueueConsumer, is_kafka_error
from .pg_queue import PgQueueConsumer
from .pipeline import IndexPipeline, IndexResult
from .relay import OutboxRelay
from .table_statistics import MemoryTableStatistics
from .transport import Consumer, Message

__all__ = [
    "IndexerWorker",
    "OutboxRelay",
    "is_transient",
    "make_consumer",
    "run_indexer_main",
    "run_relay_main",
]

log = logging.getLogger(__name__)

READY_DATABASE_SECONDS = 3.0  # /readyz's database check (a healthcheck's timeout is a few seconds)

_TRANSIENT_ASYNCPG = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.TransactionRollbackError,  # deadlock, serialization failure
    asyncpg.LockNotAvailableError,  # the background lock timeout: the batch is retried
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
)


def is_transient(exc: BaseException) -> bool:
    """True for outages worth retrying the whole batch for (database, broker or embedding service away)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError):
            return True
        if isinstance(current, _TRANSIENT_ASYNCPG) or is_kafka_error(current):
            return True
        if isinstance(current, IndexChanged):  # a reindex switched: encode again for the new generation
            return True
        # The embedding service is away or misconfigured: no turn is at fault, so none is
        # dead-lettered; the batch goes back and is tried again (a refusal was logged loudly).
        if isinstance(current, EmbeddingServiceError):
            return True
        current = current.__cause__ or current.__context__
    return False


def make_consumer(db: Database, settings: Settings) -> Consumer:
    """Kafka when KAFKA_BOOTSTRAP_SERVERS is set, else the Postgres outbox."""
    if settings.kafka_bootstrap_servers:
        return KafkaQueueConsumer(settings)
    return PgQueueConsumer(db, settings)


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class _BatchUnavailable(Exception):
    """The batch was given back because the database or broker is away."""


def _describe(exc: BaseException) -> str:
    # SQLAlchemy's text repeats the statement and its parameters (user text); keep the driver's error.
    if isinstance(exc, sa_exc.DBAPIError):
        exc = getattr(exc.orig, "__cause__", None) or exc.orig or exc
    return f"{type(exc).__name__}: {exc}"[:4000]


class IndexerWorker:
    """Consumes finished turns and writes them to the memory index."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        embedder: Embedder,
        *,
        consumer: Consumer | None = None,
        backoff_base_seconds: float = 0.5,
        backoff_max_seconds: float = 30.0,
        statistics: MemoryTableStatistics | None = None,
        facts: FactAsker | None = None,
        vectors: VectorCache | None = None,
    ) -> None:
        self.settings = settings
        # vectors: the API's recall cache, when this worker runs in the API's process.
        self.pipeline = IndexPipeline(db, embedder, settings, facts=facts, vectors=vectors)
        self.statistics = statistics if statistics is not None else MemoryTableStatistics(db)
        self.consumer = consumer if consumer is not None else make_consumer(db, settings)
        self._backoff_base = backoff_base_seconds
        self._backoff_max = backoff_max_seconds
        # indexed_turns, chunks, dead_lettered, batches, retried_batches (for logs, tests and the bench).
        self.stats: Counter[str] = Counter()
        # Why the last batch was given back, if the queue, broker, database or embedding service
        # was away (None once a poll went through again; a memory index that refuses says so itself).
        self.unavailable: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Index until `stop` is set; the batch in hand is finished before returning."""
        await self.consumer.start()
        delay = self._backoff_base
        try:
            while not stop.is_set():
                try:
                    batch = await self.consumer.poll_batch(
                        self.settings.indexer_batch_size, self.settings.indexer_batch_wait_ms / 1000
                    )
                    if batch:
                        await self.process(batch)
                    delay = self._backoff_base
                    self.unavailable = None
                except Exception as exc:
                    if not is_transient(exc) and not isinstance(exc, _BatchUnavailable):
                        raise
                    if not _caused_by(exc, IndexChanged):
                        self.unavailable = _describe(exc.__cause__ or exc)[:300]
                    log.warning(
                        "indexer: database, broker or embedding service unavailable, retrying in %.1fs: %r",
                        delay,
                        exc,
                    )
                    self.stats["retried_batches"] += 1
                    metrics.RETRIED_BATCHES.inc()
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                    except TimeoutError:
                        pass
                    delay = min(delay * 2, self._backoff_max)
        finally:
            await self.consumer.stop()

    async def process(self, batch: Sequence[Message]) -> None:
        """Index one polled batch, dead-letter what must be, then commit the transport."""
        started = time.perf_counter()
        chunks_before = self.stats["chunks"]
        poison: list[tuple[Message, str]] = []
        good: list[Message] = []
        for message in batch:
            error = message.decode_error or self.pipeline.validate(message.payload)
            if error is None:
                good.append(message)
            else:
                poison.append((message, f"PoisonPayload: {error}"))
        dead = list(poison)
        try:
            try:
                if good:
                    self._count(await self.pipeline.index([m.payload for m in good]))
            except Exception as exc:
                if is_transient(exc):
                    raise
                log.warning("indexer: batch of %d failed (%r); indexing one by one", len(good), exc)
                dead.extend(await self._one_by_one(good))
            for message, error in poison:
                await self.consumer.dead_letter(message, error)
                self.stats["dead_lettered"] += 1
            if dead:
                # Before the transport's commit: if marking them fails, the batch comes back and
                # they are marked then (after the commit, a failed mark left a Kafka dead letter's
                # row pending for good, and its conversation's watermark below it).
                await self.pipeline.pass_over([(m.payload, error) for m, error in dead])
            await self.consumer.commit(batch)
        except Exception as exc:
            if not is_transient(exc):
                raise
            await self._give_back(batch)
            raise _BatchUnavailable(str(exc)) from exc
        self.stats["batches"] += 1
        for _ in poison:
            metrics.observe_dead_letter("poison")
        metrics.observe_committed([m.payload for m in batch], time.perf_counter() - started)
        await self._refresh_statistics(self.stats["chunks"] - chunks_before)

    async def _refresh_statistics(self, rows: int) -> None:
        """After many rows were written: the planner's statistics (searches are planned from them)."""
        try:
            if await self.statistics.wrote(rows):
                self.stats["analyzed"] += 1
        except Exception as exc:  # the batch is committed; autovacuum will analyze in time
            log.warning("indexer: refreshing memory_items statistics failed: %r", exc)

    async def _one_by_one(self, messages: Sequence[Message]) -> list[tuple[Message, str]]:
        """Index each message alone; returns the ones dead-lettered, with their errors."""
        dead: list[tuple[Message, str]] = []
        for message in messages:
            failures = 0
            while True:
                try:
                    self._count(await self.pipeline.index([message.payload]))
                    break
                except Exception as exc:
                    if is_transient(exc):
                        raise
                    failures += 1
                    message.attempts += 1
                    if failures >= self.settings.indexer_max_attempts:
                        log.error("indexer: dead-lettering turn after %d attempts: %r", failures, exc)
                        error = _describe(exc)
                        dead.append((message, error))
                        await self.consumer.dead_letter(message, error)
                        self.stats["dead_lettered"] += 1
                        metrics.observe_dead_letter("failed")
                        break
                    await asyncio.sleep(min(self._backoff_base * 2 ** (failures - 1), self._backoff_max))
        return dead

    async def _give_back(self, batch: Sequence[Message]) -> None:
        try:
            await self.consumer.abandon(batch)
        except Exception:  # the transport is what failed; stop() or the next poll cleans up
            log.debug("indexer: abandoning the batch failed", exc_info=True)

    def _count(self, result: IndexResult) -> None:
        self.stats["indexed_turns"] += result.indexed_turns
        self.stats["chunks"] += result.chunks
        self.stats["keys"] += result.keys
        self.stats["facts"] += result.facts
        metrics.observe_indexed(
            result.indexed_turns, result.chunks, sentences=result.keys, facts=result.facts
        )


@contextmanager
def _stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def _database(settings: Settings) -> Database:
    if not settings.database_url:
        raise ValueError("DATABASE_URL is not set (the CLI resolves it for the embedded server)")
    return Database(settings.database_url, pool_size=settings.db_pool_size)


def serve_metrics(settings: Settings, readiness: Readiness | None = None) -> None:
    """Serve this worker's /metrics, /healthz and (with `readiness`) /readyz on METRICS_PORT, if set."""
    if settings.metrics_port is None:
        return
    serve_health(settings.host, settings.metrics_port, readiness)
    log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)


async def run_relay_main(settings: Settings) -> None:
    """`chatmem relay`: publish the outbox to Kafka until SIGTERM/SIGINT."""
    serve_metrics(settings)
    db = _database(settings)
    stop = asyncio.Event()
    try:
        with _stop_on_signals(stop):
            await OutboxRelay(db, settings).run(stop)
    finally:
        await db.dispose()


async def run_indexer_main(
    settings: Settings,
    *,
    embedder: Embedder | None = None,
    facts: FactAsker | None = None,
    on_refused: Callable[[str | None], None] | None = None,
) -> None:
    """`chatmem indexer`: index finished turns until SIGTERM/SIGINT (``facts``: FACT_KEYS=model;
    ``on_refused``: told when its memory index starts or stops refusing memory, as ``open_index``)."""
    db = _database(settings)
    stop = asyncio.Event()
    running: list[tuple[MemoryIndex, IndexerWorker]] = []
    serve_metrics(settings, _readiness(asyncio.get_running_loop(), db, stop, running))
    try:
        encoder = embedder if embedder is not None else await load_embedder(settings, threads=0)
        model = await open_index(db, settings, encoder, threads=0, on_refused=on_refused)
        worker = IndexerWorker(db, settings, model, facts=facts)
        running.append((model, worker))
        with _stop_on_signals(stop):
            await worker.run(stop)
    finally:
        await db.dispose()


def _readiness(
    loop: asyncio.AbstractEventLoop,
    db: Database,
    stop: asyncio.Event,
    running: list[tuple[MemoryIndex, IndexerWorker]],
) -> Readiness:
    """The indexer's /readyz (indexer/health.py), asked from the server's thread."""

    def readiness() -> tuple[int, dict[str, str]]:
        if stop.is_set():
            return 503, {"status": "shutting_down"}
        if not running:
            return 503, {"status": "starting"}  # loading its encoder, opening the index
        try:
            asyncio.run_coroutine_threadsafe(db.ping(), loop).result(READY_DATABASE_SECONDS)
        except Exception as exc:
            return 503, {"status": "unavailable", "database": _describe(exc)[:200]}
        index, worker = running[0]
        refused, unavailable = index.refused, worker.unavailable
        body = {
            "status": "ready" if refused is None and unavailable is None else "unavailable",
            "database": "ok",
            "queue": "ok" if unavailable is None else f"unavailable: {unavailable}",
            "memory": "ok" if refused is None else f"unavailable: {refused[:300]}",
        }
        return (200 if body["status"] == "ready" else 503), body

    return readiness
