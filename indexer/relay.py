"""The outbox relay: publishes finished turns to Kafka and marks them only after the acks.

Rows are claimed with ``FOR UPDATE SKIP LOCKED`` in a transaction held while the batch is
published, so several relays share the outbox without taking the same row twice. The
rows are marked published in that transaction once the broker acknowledged every record
(idempotent producer, ``acks=all``); a relay that dies after the acks and before the
commit leaves the rows unmarked, they are published again, and the indexer's upsert
absorbs the duplicate. When Kafka is unreachable nothing is marked, chat goes on writing
rows, and the relay retries with exponential backoff until the backlog drains.

Ordering: one relay publishes rows in id order with key = conversation id, so a
conversation's turns land in one partition in order. With several relays, turns of one
conversation may interleave; the watermark only moves forward (GREATEST), so this can
make it run ahead of a turn that is still in flight, never backwards.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiokafka import AIOKafkaProducer
from sqlalchemy import text

from memory.config import Settings
from memory.db import Database

from . import metrics
from .pg_queue import OutboxListener

log = logging.getLogger(__name__)

CLAIM_UNPUBLISHED = text(
    """
    SELECT id, conversation_id, payload FROM outbox
    WHERE published_at IS NULL AND consumed_at IS NULL AND dead_at IS NULL
    ORDER BY id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
    """
)

MARK_PUBLISHED = text("UPDATE outbox SET published_at = now(), attempts = attempts + 1 WHERE id = ANY(:ids)")

# A record the broker has not acknowledged in this long counts as failed (aiokafka default: 40 s).
REQUEST_TIMEOUT_MS = 10_000


async def wait_for_wake_or_stop(listener: OutboxListener, stop: asyncio.Event, timeout: float) -> None:
    """Return on an outbox notification, on stop, or after `timeout` seconds."""
    waits = [asyncio.ensure_future(listener.wait(timeout)), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


class OutboxRelay:
    """Moves outbox rows to the Kafka topic of turns."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        backoff_base_seconds: float = 0.5,
        backoff_max_seconds: float = 30.0,
    ) -> None:
        if not settings.kafka_bootstrap_servers:
            raise ValueError("the relay needs KAFKA_BOOTSTRAP_SERVERS")
        self._db = db
        self._settings = settings
        self._backoff_base = backoff_base_seconds
        self._backoff_max = backoff_max_seconds
        self.published = 0

    async def _open_producer(self) -> AIOKafkaProducer:
        producer = AIOKafkaProducer(
            bootstrap_servers=self._settings.kafka_bootstrap_servers,
            enable_idempotence=True,
            acks="all",
            request_timeout_ms=REQUEST_TIMEOUT_MS,
        )
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        return producer

    async def publish_once(self, producer: AIOKafkaProducer) -> int:
        """Publish one batch of unpublished rows; returns how many were published and marked."""
        async with self._db.transaction() as session:
            rows = (
                await session.execute(CLAIM_UNPUBLISHED, {"limit": self._settings.relay_batch_size})
            ).all()
            if not rows:
                return 0
            # send() only enqueues; the futures resolve when the broker acknowledged (acks=all).
            acks = [
                await producer.send(
                    self._settings.kafka_topic,
                    json.dumps(row.payload, separators=(",", ":")).encode(),
                    key=str(row.conversation_id).encode(),
                )
                for row in rows
            ]
            await asyncio.gather(*acks)
            await session.execute(MARK_PUBLISHED, {"ids": [row.id for row in rows]})
        self.published += len(rows)
        metrics.RELAY_PUBLISHED.inc(len(rows))
        return len(rows)

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until `stop` is set: woken by NOTIFY, polling as a fallback, backing off on errors."""
        listener = OutboxListener(self._db.url)
        await listener.start()
        producer: AIOKafkaProducer | None = None
        delay = self._backoff_base
        try:
            while not stop.is_set():
                try:
                    if producer is None:
                        producer = await self._open_producer()
                    published = await self.publish_once(producer)
                except Exception as exc:
                    # Kafka or Postgres away: keep the rows, drop the producer, try again later.
                    log.warning("relay: publish failed, retrying in %.1fs: %r", delay, exc)
                    metrics.RELAY_FAILURES.inc()
                    if producer is not None:
                        await _close_quietly(producer)
                        producer = None
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                    except TimeoutError:
                        pass
                    delay = min(delay * 2, self._backoff_max)
                    continue
                delay = self._backoff_base
                if published < self._settings.relay_batch_size:
                    await wait_for_wake_or_stop(listener, stop, self._settings.relay_poll_seconds)
        finally:
            try:
                if producer is not None:
                    await _close_quietly(producer)
            finally:
                await listener.stop()


async def _close_quietly(producer: AIOKafkaProducer) -> None:
    try:
        await producer.stop()
    except Exception:  # a producer that lost its broker may fail to flush; its rows stay unmarked
        log.debug("relay: producer stop failed", exc_info=True)
