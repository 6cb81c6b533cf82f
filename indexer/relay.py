"""The outbox relay: publishes finished turns to Kafka and marks them only after the acks.

Rows are claimed as leases (see `indexer/outbox_claims.py`: fair across users, live turns
before imported history, committed at once), so no transaction is open while the batch
is published and a user's erasure never waits on the broker. The rows are marked
published in a short transaction once the broker acknowledged every record (idempotent
producer, ``acks=all``); a relay that dies after the acks and before the mark (or whose
mark fails) leaves the rows unmarked, they are published again when the lease runs out,
and the indexer's upsert absorbs the duplicate. When Kafka is unreachable the lease is
given back, chat goes on writing rows, and the relay retries with exponential backoff until
the backlog drains.

Imported history goes to its own topic (``KAFKA_HISTORY_TOPIC``), which the indexer reads
only while the topic of live turns has nothing waiting: a big import never delays a live turn
of another conversation (one behind its own conversation's unpublished history follows it there).

Ordering: one relay publishes rows in id order per user with key = conversation id, so a
conversation's turns land in one partition in order. With several relays, turns of one
conversation may interleave; the watermark does not depend on the order: it moves only over
turns whose outbox rows the indexer marked consumed (indexer/pipeline.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from aiokafka import AIOKafkaProducer
from sqlalchemy import text

from memory.config import Settings
from memory.storage.db import Database

from . import metrics
from .outbox_claims import CLAIM_FOR_RELAY, LeaseKeeper, OutboxClaims
from .pg_queue import OutboxListener

log = logging.getLogger(__name__)

MARK_PUBLISHED = text(
    "UPDATE outbox SET published_at = now(), claimed_until = NULL, claim_token = NULL WHERE id = ANY(:ids)"
)

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
        self._claims = OutboxClaims(
            db,
            lease_seconds=settings.outbox_lease_seconds,
            lock_timeout_ms=settings.background_lock_timeout_ms,
        )
        self._leases = LeaseKeeper(self._claims)
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
        rows = await self._claims.claim(CLAIM_FOR_RELAY, self._settings.relay_batch_size)
        if not rows:
            return 0
        ids = [row.id for row in rows]
        self._leases.held.update(ids)
        try:
            # send() only enqueues; the futures resolve when the broker acknowledged (acks=all).
            acks = [
                await producer.send(
                    self._settings.history_topic if row.priority else self._settings.kafka_topic,
                    json.dumps(row.payload, separators=(",", ":")).encode(),
                    key=str(row.conversation_id).encode(),
                )
                for row in rows
            ]
            await asyncio.gather(*acks)
        except Exception:
            # Kafka away: give the rows back for the next try (if the database is what failed,
            # the lease runs out instead).
            self._leases.held.difference_update(ids)
            with contextlib.suppress(Exception):
                await self._claims.release(ids)
            raise
        try:
            async with self._db.transaction(
                lock_timeout_ms=self._settings.background_lock_timeout_ms
            ) as session:
                await session.execute(MARK_PUBLISHED, {"ids": ids})
        finally:
            # Marked, or not (the database away): either way no longer renewed. Unmarked rows come
            # back when their lease runs out and are sent again; the indexer absorbs the duplicate.
            self._leases.held.difference_update(ids)
        self.published += len(rows)
        metrics.RELAY_PUBLISHED.inc(len(rows))
        return len(rows)

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until `stop` is set: woken by NOTIFY, polling as a fallback, backing off on errors."""
        listener = OutboxListener(self._db.url)
        await listener.start()
        self._leases.start()
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
                await self._leases.stop()
                if producer is not None:
                    await _close_quietly(producer)
            finally:
                await listener.stop()


async def _close_quietly(producer: AIOKafkaProducer) -> None:
    try:
        await producer.stop()
    except Exception:  # a producer that lost its broker may fail to flush; its rows stay unmarked
        log.debug("relay: producer stop failed", exc_info=True)
