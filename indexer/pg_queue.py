"""The embedded transport: the indexer claims outbox rows straight from Postgres.

A batch is claimed as a lease (see `indexer/outbox_claims.py`): one short transaction
stamps the rows and commits, the pipeline embeds and writes with no transaction of the
queue open (marking the rows consumed with their memory, as on Kafka, and clearing their
leases in that same write), and `commit` marks what is left (the batch's dead letters, a row the
pipeline did not match) in another short transaction. Several indexers
never take the same unexpired row; a crashed indexer's rows not yet consumed are claimed
again once its lease runs out, and a redelivery is absorbed by the idempotent upsert.
Every transaction here carries the background lock timeout, so none waits forever.

A dead letter is kept in `dead_letters` at once (one row per outbox row, however often it is
dead-lettered): the worker marks its outbox row dead before the commit (indexer/pipeline.py,
`pass_over`), and a row marked dead is never delivered again, so a `dead_letters` row written
only at commit was lost when that commit failed. The commit marks it dead by id as well (a
row whose payload names no turn of its own is matched by nothing else).

Attempt counts: the claim counts every delivery in the row (it survives a crash); the
worker counts failures in process (see `indexer/worker.py`) and writes the figure it
dead-letters with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import asyncpg
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB

from memory.config import Settings
from memory.record.outbox import NOTIFY_CHANNEL
from memory.storage.db import Database, asyncpg_dsn

from .outbox_claims import CLAIM_FOR_INDEXER, LeaseKeeper, OutboxClaims
from .transport import Message

log = logging.getLogger(__name__)

# The rows the pipeline did not consume with their memory (it did, and cleared their leases, in
# the same write: each row is written once per batch); a payload naming a turn not its own, or a
# batch committed without the pipeline.
MARK_CONSUMED = text(
    """
    UPDATE outbox SET consumed_at = now(), claimed_until = NULL, claim_token = NULL
    WHERE id = ANY(:ids) AND consumed_at IS NULL AND dead_at IS NULL
    """
)

INSERT_DEAD_LETTER = text(
    """
    INSERT INTO dead_letters (source, outbox_id, payload, error)
    SELECT 'outbox', CAST(:outbox_id AS bigint), :payload, CAST(:error AS text)
    WHERE NOT EXISTS (
        SELECT 1 FROM dead_letters WHERE source = 'outbox' AND outbox_id = CAST(:outbox_id AS bigint)
    )
    """
).bindparams(bindparam("payload", type_=JSONB))

MARK_DEAD = text(
    "UPDATE outbox SET dead_at = coalesce(dead_at, now()), last_error = :error, attempts = :attempts,"
    " claimed_until = NULL, claim_token = NULL WHERE id = :id"
)


class OutboxListener:
    """LISTEN on the outbox channel over a dedicated connection; `wait` falls back to polling."""

    def __init__(self, database_url: str, channel: str = NOTIFY_CHANNEL) -> None:
        self._dsn = asyncpg_dsn(database_url)
        self._channel = channel
        self._conn: asyncpg.Connection | None = None
        self._woken = asyncio.Event()

    def _on_notify(self, *_: Any) -> None:
        self._woken.set()

    async def _connect(self) -> None:
        try:
            conn = await asyncpg.connect(self._dsn)
            await conn.add_listener(self._channel, self._on_notify)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            # Without LISTEN the callers still poll; say so once per failure and carry on.
            log.warning("outbox LISTEN unavailable, polling instead: %s", exc)
            return
        self._conn = conn
        # Rows committed while we were not listening must not wait for the next poll.
        self._woken.set()

    async def start(self) -> None:
        """Open the LISTEN connection (failure only degrades to polling)."""
        await self._connect()

    @property
    def listening(self) -> bool:
        """Whether notifications can arrive (else the callers only poll)."""
        return self._conn is not None and not self._conn.is_closed()

    async def wait(self, timeout: float) -> bool:
        """Return when a notification arrived since the last wait (True), or after `timeout` seconds."""
        if self._conn is None or self._conn.is_closed():
            self._conn = None
            await self._connect()
        woken = True
        try:
            await asyncio.wait_for(self._woken.wait(), timeout)
        except TimeoutError:
            woken = False
        self._woken.clear()
        return woken

    async def stop(self) -> None:
        """Close the LISTEN connection."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            await conn.close()


class PgQueueConsumer:
    """The indexer's Postgres transport over the outbox table."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self._db = db
        self._poll_seconds = settings.relay_poll_seconds
        self._lock_timeout_ms = settings.background_lock_timeout_ms
        self._listener = OutboxListener(db.url)
        self._claims = OutboxClaims(
            db,
            lease_seconds=settings.outbox_lease_seconds,
            lock_timeout_ms=settings.background_lock_timeout_ms,
        )
        self._leases = LeaseKeeper(self._claims)
        # Dead letters of the batch in hand, written with its commit.
        self._dead: list[tuple[Message, str]] = []
        # When a claim last found nothing (None: rows may be waiting), and whether a
        # notification has come since: an idle consumer claims only then, or once per poll.
        self._idle_since: float | None = None
        self._notified = False

    async def start(self) -> None:
        """Start listening for new outbox rows, and renewing the leases this consumer holds."""
        await self._listener.start()
        self._leases.start()

    def _claim_due(self) -> bool:
        """Whether rows may be waiting: the last claim found some, a notification came since,
        nothing can notify, or the poll interval has passed since the queue was found empty."""
        return (
            self._idle_since is None
            or self._notified
            or not self._listener.listening
            or time.monotonic() - self._idle_since >= self._poll_seconds
        )

    async def poll_batch(self, max_records: int, timeout: float) -> list[Message]:
        """Lease up to `max_records` unconsumed rows (live turns first, fair across users).

        An idle queue is not claimed from at every call: once a claim finds nothing, the next
        waits for a notification (every outbox write sends one) or the poll interval. The
        run loop calls this back to back, so claiming at each call's start and end kept an
        idle indexer at ~10 claim transactions a second.
        """
        deadline = time.monotonic() + timeout
        claimed: list[Message] = []
        while True:
            if claimed or self._claim_due():
                try:
                    rows = await self._claims.claim(CLAIM_FOR_INDEXER, max_records - len(claimed))
                except Exception:
                    if not claimed:
                        raise
                    # The rows leased so far go out as the batch: dropped here, they stayed in the
                    # leases this consumer renews, and were never delivered while it lived.
                    log.warning("indexer: claiming more outbox rows failed; going on with %d", len(claimed))
                    return claimed
                self._notified = False
                self._idle_since = None if rows or claimed else time.monotonic()
                self._leases.held.update(row.id for row in rows)
                claimed.extend(
                    Message(
                        payload=row.payload,
                        handle=row.id,
                        attempts=row.attempts,
                        key=str(row.conversation_id),
                    )
                    for row in rows
                )
            remaining = deadline - time.monotonic()
            if len(claimed) >= max_records or remaining <= 0:
                return claimed
            if await self._listener.wait(min(remaining, self._poll_seconds)):
                self._notified = True

    async def commit(self, messages: Sequence[Message]) -> None:
        """Mark the batch consumed (and its dead letters dead) in one transaction."""
        ids = [m.handle for m in messages]
        dead, self._dead = self._dead, []
        async with self._db.transaction(lock_timeout_ms=self._lock_timeout_ms) as session:
            for message, error in dead:
                await session.execute(
                    MARK_DEAD, {"id": message.handle, "error": error, "attempts": message.attempts}
                )
            if ids:
                await session.execute(MARK_CONSUMED, {"ids": ids})
        self._leases.held.difference_update(ids)

    async def abandon(self, messages: Sequence[Message]) -> None:
        """Give the batch back: the rows are claimable again at once."""
        ids = [m.handle for m in messages]
        self._dead = [(m, e) for m, e in self._dead if m.handle not in ids]
        self._leases.held.difference_update(ids)
        await self._claims.release(ids)
        self._idle_since = None  # claimable again, and no notification says so

    async def dead_letter(self, message: Message, error: str) -> None:
        """Keep the message with its error in `dead_letters` now; its outbox row is marked dead at commit."""
        async with self._db.transaction(lock_timeout_ms=self._lock_timeout_ms) as session:
            await session.execute(
                INSERT_DEAD_LETTER, {"outbox_id": message.handle, "payload": message.payload, "error": error}
            )
        self._dead.append((message, error))

    async def stop(self) -> None:
        """Give back what is still leased and stop listening."""
        try:
            await self._leases.stop()
            held, self._dead = sorted(self._leases.held), []
            self._leases.held.clear()
            if held:
                try:
                    await self._claims.release(held)
                except Exception:  # the database is away: the leases run out by themselves
                    log.warning("indexer: could not release %d leased outbox rows", len(held), exc_info=True)
        finally:
            await self._listener.stop()
